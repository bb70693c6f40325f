"""Hand a trained model to the Hugging Face ecosystem, and take one back.

    python -m tools.export_hf runs/train --out runs/train/hf
    python -m tools.export_hf --import runs/train/hf --out runs/imported.pt

Export writes a folder that ``transformers.AutoModelForCausalLM.from_pretrained`` loads as a
Llama: config.json, model.safetensors, and the run's tokenizer that ``AutoTokenizer`` loads,
so ``generate`` works on text: the byte-level one (token id = byte value, as ours), or the
tokenizer.json of the prepared folder it trained on (python -m tools.prepare_data), with its
end-of-text token as the model's end and start of a text. Then it loads the folder
with transformers and prints how far its logits are from ours on a test text. Import reads
such a folder back into one file of our weights (the layout of ``python -m common.checkpoint
export``), which ``python -m tools.generate`` and ``torch.load`` read. The mapping, RoPE's
row order included, is in common/hf.py.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a file: find common/

import torch

from common.errors import UserError, main_guard
from common.generate import codec_for, find_weights, load_trained
from common.hf import (byte_tokenizer, from_hf_state_dict, llama_config, model_config, refuse_moe, require,
                       to_hf_state_dict)
from common.model import Transformer


def export(run, out, tokenizer: str | None = None) -> Path:
    """Write the run's model as a transformers Llama folder; return the folder."""
    found = find_weights(run)
    refuse_moe(found.cfg)
    codec = codec_for(found, tokenizer)
    safetensors = require("safetensors.torch")
    trained = load_trained(found)  # fp32 on the CPU, whatever the run trained in
    cfg = trained.cfg
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--out {out} cannot be made ({e.strerror or type(e).__name__}); give a folder you can "
                        f"write to.") from None
    config = llama_config(cfg)
    config.architectures = ["LlamaForCausalLM"]
    if codec.eot:  # every prepared document starts with it: the end of one text and the start of the next
        config.bos_token_id = config.eos_token_id = codec.start[0]
    config.save_pretrained(out)
    tensors = to_hf_state_dict(trained.model.state_dict(), cfg)
    safetensors.save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    if codec.tokenizer is None:
        byte_tokenizer().save_pretrained(out)
    else:
        transformers = require("transformers")
        transformers.PreTrainedTokenizerFast(tokenizer_object=codec.tokenizer, bos_token=codec.eot, eos_token=codec.eot,
                                             clean_up_tokenization_spaces=False).save_pretrained(out)
    what = "a byte-level tokenizer" if codec.tokenizer is None else f"the tokenizer of {codec.name}"
    print(f"wrote {out}: config.json, model.safetensors ({len(tensors)} tensors of the {trained.name} model from "
          f"{trained.source}) and {what}", flush=True)
    return out


def compare(run, folder, text: str = "def fib(n):\n    return", tokenizer: str | None = None) -> float:
    """Largest difference between transformers' logits for ``text`` and ours (fp32, CPU)."""
    transformers = require("transformers")
    found = find_weights(run)
    ours = load_trained(found).model
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    codec = codec_for(found, tokenizer)
    x = torch.tensor([codec.start + codec.encode(text)])
    with torch.no_grad():
        return (ours(x) - theirs(x).logits).abs().max().item()


def import_hf(folder, dest) -> Path:
    """A transformers Llama folder back into one file of our weights."""
    folder, dest = Path(folder), Path(dest)
    if not (folder / "config.json").is_file() or not (folder / "model.safetensors").is_file():
        raise UserError(f"--import {folder} is not an exported model: it needs config.json and model.safetensors.")
    safetensors = require("safetensors.torch")
    transformers = require("transformers")
    hf_config = transformers.AutoConfig.from_pretrained(folder)
    if hf_config.model_type != "llama":
        raise UserError(f"--import {folder} holds a {hf_config.model_type!r} model; only Llama models map onto ours.")
    cfg = model_config(hf_config)
    state = from_hf_state_dict(safetensors.load_file(str(folder / "model.safetensors")), cfg)
    with torch.device("meta"):  # every name and shape checked before anything is written
        Transformer(cfg).load_state_dict(state, strict=True, assign=True)
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(dest.name + ".partial")
    torch.save({"model_config": cfg.as_dict(), "step": None, "model": state}, partial)
    os.replace(partial, dest)
    print(f"wrote {dest}: {len(state)} tensors of our model, from {folder}", flush=True)
    return dest


@main_guard
def main(argv=None):
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m tools.export_hf", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", nargs="?", help="a run's --out folder (or its weights.pt, or one checkpoint step_...)")
    p.add_argument("--out", required=True, help="the folder to write (export), or the .pt file (--import)")
    p.add_argument("--import", dest="import_dir", default=None, metavar="HF_DIR",
                   help="read an exported folder back into one file of our weights instead")
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="a prepared folder or a tokenizer.json (default: the run's --data folder's tokenizer, else "
                        "bytes); for a run whose data folder has moved")
    p.add_argument("--no-check", dest="check", action="store_false",
                   help="export without loading the folder with transformers to compare its logits with ours")
    args = p.parse_args(argv)
    if (args.run is None) == (args.import_dir is None):
        raise UserError("give either a run folder to export or --import HF_DIR, not both and not neither.")
    if args.import_dir is not None:
        import_hf(args.import_dir, args.out)
        return
    export(args.run, args.out, args.tokenizer)
    if args.check:
        diff = compare(args.run, args.out, tokenizer=args.tokenizer)
        print(f"transformers' LlamaForCausalLM loads it: its logits differ from ours by at most {diff:.2g} "
              f"(fp32, CPU)", flush=True)


if __name__ == "__main__":
    main()
