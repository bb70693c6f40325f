"""Text from a trained model: load any run's weights, then sample one token at a time.

Loading: a run leaves its weights either as one plain file (``--save-weights``:
OUT/weights.pt, full tensors gathered by rank 0) or as DCP checkpoints (OUT/checkpoints/
step_.../), sharded however the run was split (DDP, FSDP, TP, PP, 2-D, 3-D, EP). DCP names
every tensor by the model's own parameter name, so one process without any process group
can read a sharded checkpoint into a whole model: ``dcp.load(..., no_dist=True)`` fills
the full-size tensors it is given from whichever shards hold their pieces.

Generating: the model's ``forward(tokens)`` is the training path and stays as it is (every
strategy wraps it from outside). Sampling calls the same modules in another order, through
``forward_cached``, which keeps each layer's keys and values (the KV cache):

Without a cache, token t+1 costs a forward over all t+1 positions, because attention at the
last position needs the keys and values of every earlier one; over n new tokens that is
O(n^2) positions of work, nearly all of it recomputing what the previous step already had.
A position's key and value depend only on the tokens up to it (the mask is causal), so they
never change once computed: keep them, and each new token costs one position, its own q, k,
v and MLP, plus one attention row that reads the cached keys and values.
"""
from __future__ import annotations

import json
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from common.errors import UserError
from common.model import PRESETS, ModelConfig, Transformer, apply_rope, rope_tables


# ---- loading any run's weights ---------------------------------------------------------------
@dataclass
class Weights:
    """Where a run's weights are and what they are, known before a byte of them is read."""
    source: Path      # weights.pt (or an export file), or a checkpoint folder
    cfg: ModelConfig
    context: int      # positions the run trained on: its --seq-len (the most a prompt may be)
    name: str         # the run's --model preset
    data: str | None = None  # the run's --data (a prepared folder holds its tokenizer)


@dataclass
class Trained(Weights):
    model: Transformer = None


def find_weights(path) -> Weights:
    """The weights of a run folder (the newer of weights.pt and the newest checkpoint), of a
    weights file, or of one checkpoint folder; one sentence if there are none."""
    source, settings = _weights_source(Path(path))
    cfg = ModelConfig(**settings["model_config"])
    context = min(int(settings.get("seq_len") or cfg.max_seq_len), cfg.max_seq_len)
    return Weights(source, cfg, context, settings.get("model", "?"), settings.get("data"))


def require_bytes(found: Weights) -> None:
    """Text is bytes: a model of another vocabulary (--vocab-size) learned random ids, not text."""
    if found.cfg.vocab_size != 256:
        raise UserError(f"{found.source} holds a model of {found.cfg.vocab_size} token ids (--vocab-size), trained on "
                        f"random ids, not on text's 256 byte values: it has no text to give; use a run of the byte "
                        f"vocabulary.")


@dataclass
class Codec:
    """Text to a run's token ids and back: the bytes, or the tokenizer of the prepared folder
    it trained on (tools/prepare_data.py)."""
    name: str                             # "bytes", or the tokenizer's folder or file
    encode: Callable[[str], list[int]]
    decode: Callable[[list], str]
    start: list[int] = field(default_factory=list)  # put before a prompt: the end-of-text token that
    eot: str | None = None                          # starts every prepared document, so a prompt starts one
    tokenizer: object = None              # the tokenizers.Tokenizer (None for bytes)


def codec_for(found: Weights, tokenizer: str | None = None) -> Codec:
    """The run's own: ``tokenizer`` (a prepared folder or a tokenizer.json) if given, else its
    --data folder's if that is a prepared one, else the bytes (one sentence where none fits)."""
    from common import prepared
    data = found.data if found.data not in (None, "stdlib", "synthetic") else None
    where = tokenizer or (data if data and prepared.is_prepared(data) else None)
    if where is None:
        if found.cfg.vocab_size != 256 and data:  # only a prepared folder trains another vocabulary on text
            raise UserError(f"{found.source} was trained on the prepared folder {data}, which is not there any more; "
                            f"give its tokenizer: --tokenizer PATH/tokenizer.json.")
        require_bytes(found)
        return Codec("bytes", encode, decode)
    tok, eot = prepared.load_tokenizer(where)
    if prepared.vocab_size_of(tok) != found.cfg.vocab_size:
        raise UserError(f"{where}'s tokenizer has {prepared.vocab_size_of(tok)} tokens and the model of {found.source} "
                        f"{found.cfg.vocab_size}; give the tokenizer the run trained with (--tokenizer).")
    tok.encode_special_tokens = True  # as prepare encoded: "<|endoftext|>" typed in a prompt is text
    return Codec(str(where), lambda text: tok.encode(text, add_special_tokens=False).ids,
                 lambda ids: tok.decode([int(i) for i in ids], skip_special_tokens=False),
                 [tok.token_to_id(eot)] if eot else [], eot, tok)


def _weights_source(path: Path) -> tuple[Path, dict]:
    """(weights.pt or a checkpoint folder, the run's settings: model, model_config, seq_len)."""
    from common.checkpoint_meta import complete_checkpoints, read_meta

    path = Path(path)
    if path.is_file():  # OUT/weights.pt given directly, or a file of `python -m common.checkpoint export`
        folder = path.parent
    elif (path / "meta.json").is_file():  # one checkpoint, step_...
        return path, read_meta(path)
    else:
        folder = path
    if not folder.is_dir():
        raise UserError(f"{path} does not exist; give a run's --out folder (it holds weights.pt or checkpoints/).")
    plain = path if path.is_file() else folder / "weights.pt"
    found = complete_checkpoints(folder / "checkpoints") if not path.is_file() else []
    newest = found[-1] if found else None
    if not plain.is_file() and newest is None:
        raise UserError(f"{path} holds no weights: train with --save-weights (OUT/weights.pt) or --ckpt-every N "
                        f"(OUT/checkpoints/) and give that run's --out folder.")
    # Both: the one written last (a run resumed without --save-weights left an older weights.pt).
    if newest is not None and (not plain.is_file() or (newest / "meta.json").stat().st_mtime > plain.stat().st_mtime):
        return newest, read_meta(newest)
    try:
        settings = json.loads((folder / "summary.json").read_text())
    except (OSError, json.JSONDecodeError):
        settings = {}
    if "model_config" not in settings:  # an export or import file carries its config
        saved = _read(plain)
        if "model_config" in saved:
            cfg = saved["model_config"]
            name = next((n for n, c in PRESETS.items() if c.as_dict() == cfg), "custom")
            settings = {"model": name, "model_config": cfg, "seq_len": cfg["max_seq_len"]}
    if "model_config" not in settings:
        raise UserError(f"{plain} has no summary.json beside it to say which model it holds; keep the run's "
                        f"--out folder whole.")
    return plain, settings


def _read(path: Path) -> dict:
    """A torch.save file of tensors (weights_only: a file from elsewhere runs no code)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file, said plainly
        raise UserError(f"{path} cannot be read as a file of weights ({type(e).__name__}); give the weights.pt "
                        f"of a finished run.") from None


def load_state(source: Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The model's full state dict (on the CPU) from weights.pt, an export file or a checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    with torch.device("meta"):
        model = Transformer(cfg)
    want = {k: torch.empty(v.shape, dtype=v.dtype) for k, v in model.state_dict().items()}
    if source.is_file():
        state = _read(source)
        state = state.get("model", state)  # export's file: {"model_config", "step", "model"}
    else:
        state = {"model": want}
        try:  # only the model's tensors are read, not the optimizer's
            with warnings.catch_warnings():  # "...assuming the intent is to load in a single process": it is
                warnings.filterwarnings("ignore", "torch.distributed is disabled")
                dcp.load(state, checkpoint_id=str(source), no_dist=True)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - a damaged checkpoint, said plainly
            reason = (str(e).strip().splitlines() or [type(e).__name__])[-1][:200]
            raise UserError(f"checkpoint {source} cannot be read ({reason}); give an older one.") from None
        state = state["model"]
    if set(state) != set(want):
        raise UserError(f"{source} does not hold this model's weights ({len(set(want) - set(state))} missing, "
                        f"{len(set(state) - set(want))} unknown names); give the file of a run of this tutorial.")
    return state


def load_trained(path, device="cpu", dtype: torch.dtype = torch.float32) -> Trained:
    """The trained model of a run folder, weights file or checkpoint (or of ``find_weights``'
    answer), ready for inference."""
    found = path if isinstance(path, Weights) else find_weights(path)
    state = load_state(found.source, found.cfg)
    with torch.device("meta"):
        model = Transformer(found.cfg)
    model.to_empty(device=device)
    model.load_state_dict(state)
    cos, sin = rope_tables(found.cfg, device)  # not saved: a function of the config
    model.rope_cos.copy_(cos)
    model.rope_sin.copy_(sin)
    model.to(dtype).eval()
    return Trained(found.source, found.cfg, found.context, found.name, found.data, model=model)


# ---- the KV cache ----------------------------------------------------------------------------
class KVCache:
    """Each layer's keys and values of the positions seen so far, in buffers of the full
    context, (batch, kv_heads, context, head_dim): SDPA's layout, so a step copies in one
    position's k and v and attends over a view of the first ``length`` positions."""

    def __init__(self, model: Transformer, batch: int, context: int):
        cfg, p = model.cfg, next(model.parameters())
        shape = (batch, cfg.n_kv_heads, context, cfg.head_dim)
        self.k = {name: torch.zeros(shape, device=p.device, dtype=p.dtype) for name in model.layers}
        self.v = {name: torch.zeros(shape, device=p.device, dtype=p.dtype) for name in model.layers}
        self.length, self.context = 0, context

    def add(self, name: str, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new positions' k and v (SDPA layout); return all positions' so far."""
        start, end = self.length, self.length + k.shape[2]
        self.k[name][:, :, start:end], self.v[name][:, :, start:end] = k, v
        return self.k[name][:, :, :end], self.v[name][:, :, :end]


def _attention(attn, x, cos, sin, cache: KVCache, name: str):
    """common/model.py's Attention.forward, with the keys and values of earlier positions
    taken from the cache instead of recomputed."""
    bsz, seq, _ = x.shape
    q = attn.wq(x).view(bsz, seq, -1, attn.head_dim)
    k = attn.wk(x).view(bsz, seq, -1, attn.head_dim)
    v = attn.wv(x).view(bsz, seq, -1, attn.head_dim)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k, v = cache.add(name, k.transpose(1, 2), v.transpose(1, 2))
    # A prompt fed at once (nothing cached yet) needs the causal mask; one new position
    # attends to every cached one, so it needs none.
    assert cache.length == 0 or seq == 1, "feed the prompt first, then one token at a time"
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, is_causal=cache.length == 0 and seq > 1,
                                         enable_gqa=k.shape[1] != q.shape[2])
    return attn.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


@torch.no_grad()
def forward_cached(model: Transformer, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Logits of ``tokens``, the positions that follow the ``cache.length`` cached ones."""
    h = model.tok_embeddings(tokens)
    # RoPE rotates by the absolute position: the new tokens sit after the cached ones.
    start, end = cache.length, cache.length + tokens.shape[1]
    cos, sin = (t[start:end].to(h.dtype) for t in (model.rope_cos, model.rope_sin))
    for name, layer in model.layers.items():
        h = h + _attention(layer.attention, layer.attention_norm(h), cos, sin, cache, name)
        h = h + layer.feed_forward(layer.ffn_norm(h))  # per position (an MoE router too)
    cache.length = end
    return model.output(model.norm(h))


# ---- sampling ----------------------------------------------------------------------------------
def next_token(logits: torch.Tensor, temperature: float, top_k: int | None, generator) -> torch.Tensor:
    """One token per row from the last position's logits: the most likely at temperature 0,
    else drawn from softmax(logits / temperature) over the top_k most likely."""
    logits = logits[:, -1].float()
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)


@torch.no_grad()
def generate(model: Transformer, prompt: torch.Tensor, max_new_tokens: int, context: int,
             temperature: float = 0.0, top_k: int | None = None, seed: int = 0,
             kv_cache: bool = True) -> tuple[torch.Tensor, float]:
    """``prompt`` (batch, t) followed by ``max_new_tokens`` sampled tokens, and the seconds
    they took. Positions never go past ``context``: when the text outgrows it, the cache
    restarts from the last half of the context (one forward over it), as a window slides."""
    device = prompt.device
    generator = torch.Generator(device=device).manual_seed(seed)
    tokens = prompt
    cache = KVCache(model, prompt.shape[0], context) if kv_cache else None
    # CUDA path: no CPU test: CUDA's synchronize does not exist on a CPU (the timing waits for the GPU)
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    feed = tokens  # what the model has not seen yet
    for _ in range(max_new_tokens):
        if cache is None:
            logits = model(tokens[:, -context:])  # the training path: every position again
        else:
            if cache.length + feed.shape[1] > context:  # full: start again from a window
                cache.length, feed = 0, tokens[:, -(context // 2):]
            logits = forward_cached(model, feed, cache)
        feed = next_token(logits, temperature, top_k, generator)
        tokens = torch.cat([tokens, feed], dim=1)
    # CUDA path: no CPU test: CUDA's synchronize does not exist on a CPU
    if device.type == "cuda":
        torch.cuda.synchronize()
    return tokens, time.perf_counter() - start


def encode(text: str) -> list[int]:
    """Our vocabulary is the 256 byte values: a token is a byte of the UTF-8 text."""
    return list(text.encode("utf-8"))


def decode(tokens) -> str:
    """Bytes back to text; a multi-byte character the model broke shows as U+FFFD."""
    return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")
