"""Use what you trained: continue a prompt with a run's model.

    python -m tools.generate runs/train --prompt "def fib(" --max-new-tokens 200 --temperature 0.8 --top-k 50

The run folder is any training script's --out: its OUT/weights.pt (--save-weights) or its
newest checkpoint (--ckpt-every), whichever layout trained it (one device, DDP, FSDP, TP,
PP, 2-D, 3-D, EP); a weights file or one checkpoint folder (step_...) works too. It prints
the prompt, the continuation, and how fast the new tokens came. A run on a prepared folder
(python -m tools.prepare_data) speaks its tokenizer, found through the run's --data, and its
prompt starts a document (after the end-of-text token, as every document it trained on).
The loading, the KV cache and the sampling live in common/generate.py.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a file: find common/

import torch

from common.distributed import resolve_device
from common.errors import UserError, main_guard
from common.generate import codec_for, find_weights, generate, load_trained
from common.training import AMP_DTYPES, amp_unsupported


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m tools.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", help="a run's --out folder (or its weights.pt, or one checkpoint folder step_...)")
    p.add_argument("--prompt", default="def ", help="the text to continue (default: 'def ')")
    p.add_argument("--max-new-tokens", type=int, default=200, help="tokens (bytes) to add (default: 200)")
    p.add_argument("--temperature", type=float, default=0.8,
                   help="0: always the most likely byte (greedy); higher: more varied (default: 0.8)")
    p.add_argument("--top-k", type=int, default=50, help="sample among the k most likely bytes; 0: all (default: 50)")
    p.add_argument("--seed", type=int, default=0, help="seeds the sampling (default: 0)")
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="a prepared folder or a tokenizer.json (default: the run's --data folder's tokenizer, else "
                        "bytes); for a run whose data folder has moved")
    p.add_argument("--device", default="auto", help="auto (CUDA if present, else CPU), cpu or cuda")
    p.add_argument("--amp", default="off",
                   help="the dtype of the weights, the cache and the arithmetic: bf16, fp16 (CUDA) or off (fp32) "
                        "(default: off)")
    p.add_argument("--no-kv-cache", dest="kv_cache", action="store_false",
                   help="recompute every position for every new token, the way training's forward does: "
                        "the same tokens, to see what the cache saves")
    return p


def check(args) -> None:
    if not (args.temperature >= 0 and math.isfinite(args.temperature)):
        raise UserError(f"--temperature must be 0 (greedy) or a positive number (got {args.temperature}).")
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be positive (got {args.max_new_tokens}).")
    if args.top_k < 0:
        raise UserError(f"--top-k cannot be negative (got {args.top_k}); 0 samples among all bytes.")
    if not args.prompt:
        raise UserError("--prompt is empty; give some text to continue.")
    if args.amp not in AMP_DTYPES:
        raise UserError(f"unknown --amp {args.amp!r}; choose one of {', '.join(AMP_DTYPES)}.")


@main_guard
def main(argv=None):
    args = parser().parse_args(argv)
    check(args)
    device = resolve_device(args.device, 0, 1)
    why = amp_unsupported(device, args.amp)
    if why:
        raise UserError(why)
    found = find_weights(args.run)
    codec = codec_for(found, args.tokenizer)
    prompt = codec.start + codec.encode(args.prompt)
    if len(prompt) > found.context:
        raise UserError(f"--prompt is {len(prompt)} {'bytes' if codec.name == 'bytes' else 'tokens'}, longer than the "
                        f"{found.context} positions the model was trained on (its --seq-len); give a shorter prompt.")
    trained = load_trained(found, device, AMP_DTYPES[args.amp] or torch.float32)
    tokens, seconds = generate(trained.model, torch.tensor([prompt], device=device), args.max_new_tokens,
                               trained.context, args.temperature, args.top_k, args.seed, kv_cache=args.kv_cache)
    new = tokens[0, len(prompt):].tolist()
    how = "greedy" if args.temperature == 0 else f"temperature {args.temperature:g}, top-k {args.top_k}, seed {args.seed}"
    print(f"{trained.name} model from {trained.source}, {device.type}, {'fp32' if args.amp == 'off' else args.amp}, "
          f"{how}:", flush=True)
    print(args.prompt + codec.decode(new), flush=True)
    print(f"{len(new)} tokens in {seconds:.2f} s: {len(new) / seconds:,.0f} tokens/s "
          f"({'KV cache' if args.kv_cache else 'no KV cache'})", flush=True)


if __name__ == "__main__":
    main()
