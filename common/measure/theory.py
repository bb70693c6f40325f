"""The memory and communication model of every strategy, in one place.

Per rank, for our Llama model (common/model.py) trained with AdamW:

  model state     parameters 4 bytes/param, gradients 4, AdamW's two moments 8 (+ a 4-byte
                  step counter per parameter tensor), of the parameters this rank holds;
  activations     what autograd keeps from forward for backward (below), x tokens per rank;
  communication   logical bytes per optimizer step, by collective.

Which parameters a rank holds is a product of three splits (torchtitan's order: pipeline
stage, then tensor parallel, then data parallel over what is left):
- PP: its stage's layers (``stage_layers``), the embedding on the first stage, the final
  norm and the output on the last;
- TP: 1/tp of each projection (Megatron's column/row split), norms replicated;
- DP: all of it (single, DDP), all but 1/dp of AdamW's state (ZeRO-1), or a dim-0 chunk of
  each tensor, padded to ceil(rows/dp) rows (FSDP ZeRO-2/3, HSDP over its shard group).

Activations. Counted from what autograd saves in our block (checked with
``torch.autograd.graph.saved_tensors_hooks`` and against the memory tracer), per token
and per layer, d = dim, f = ffn_dim, h = heads, kv = n_kv_heads x head_dim (the width of
k and v: attention reads grouped k/v heads as they are, nothing is copied to h heads):

  fp32, no AC   4 x (8d + 2kv + 4f + h + 2) bytes: the block input, each RMSNorm's
                normalised x and its output (3d, twice), q and attention's output (2d),
                k and v (2kv), the residual after attention (d), the MLP's w1, silu, w3
                and product (4f), attention's log-sum-exp (h) and the two norms' 1/rms (2).
                RoPE saves nothing but its tables (they need no gradient).
                On CUDA (``device="cuda"``) k and v count d each, not kv: CUDA's fp32
                attention kernel (memory-efficient) has no grouped-query support, so the
                model copies k and v to every query head and attention saves the copies.
                The flash and memory-efficient kernels save q, k, v, the output and the
                log-sum-exp (plus a few bytes of RNG state), never the seq x seq scores,
                like the CPU's flash kernel: that part is the same on both devices.
  bf16 (AMP)    24d + 4kv + 8f + 4h + 8 bytes under torch.autocast: the residual stream
                and the norms stay fp32 (the block input, normalised x, residual: 4 x 4d),
                each norm's output is cast to bf16 once and that copy is what its
                projections save (2 x 2d), q/out 2 x 2d, k/v 2 x 2kv, the MLP 4 x 2f, lse
                4h, the norms' 1/rms 8; plus, per step, a bf16 copy of every weight
                matrix (2 bytes x matmul parameters, autocast's cache) and the RoPE tables,
                cast to bf16 once per forward (4 x max_seq_len x head_dim). CUDA takes
                grouped k/v as they are too.
  CUDA's kernels (``device="cuda"``) keep 8d bytes less without AC, both dtypes: the fused
                RMSNorm keeps its input and 1/rms, not the normalised x the CPU's composite
                norm keeps (fp32, 4d a norm). Exactly the lists tools.saved_census printed on
                an H200 (1b: 100,488 bytes a token and layer in bf16, 196,744 in fp32).
  selective AC  4d + b(4d + 2kv + 2f) + 4h, b = 2 (bf16) or 4 (fp32): what
                common/parallelize/ac.py's policy keeps, the block input (fp32) and the
                outputs of the matmuls (wq, wk, wv, wo, w1, w3, w2) and of attention (its
                output and log-sum-exp); norms, RoPE, SiLU, the product and the residual
                adds are recomputed. Exact against the CPU tracer.
  selective-op  4d + b(3d + kv + f) + 4h: torchtitan's per-op policy, every second matmul
                recomputed too (wk, wo and w3 of the seven), the others' outputs kept.
  Under FSDP's bf16 policy (no autocast) the residual stream is bf16: a checkpointed
  block's input is 2d bytes, not 4d.
  full AC       the block input only: 4d (fp32 residual stream, also under autocast);
                backward recomputes one block at a time (a transient, not an activation).
  With AC, autocast's weight copies of the checkpointed blocks are saved by nothing:
  they live in autocast's cache until the autocast region ends (after the loss), a
  transient at the end of forward, not an activation.

Outside the blocks: the input batch (x and y, int64: 16 bytes/token), the final norm
(12d + 4 bytes in fp32), the logits and cross entropy's log-probabilities (4V + 4V; the
training loop holds ``logits`` until backward), or where the script asks the model for the
loss (DDP, ZeRO-1, FSDP, HSDP: ``Plan.head_loss``) the log-probabilities alone, and with
``--loss-chunks`` nothing (common/loss.py). The loss's backward is a moment of its own: two
fp32 (tokens, V) gradients at once, or one chunk's logits and softmax, the output layer's
whole gradient and its input's. Tensor parallelism divides what is sharded
(heads, MLP units, vocabulary with loss parallelism) by tp; sequence parallelism also
divides the norms' share. Pipeline stages keep the activations of the micro-batches in
flight: all m under GPipe, min(p - s, m) on stage s under 1F1B.

The peak is the largest of five moments (``_peak``): the end of forward (no gradients yet
when the last step freed them, autocast's cache still full), the loss's backward, the start
of backward (one block rebuilt), the end of backward (every gradient), and the optimizer step, where CUDA's
default foreach AdamW holds sqrt(v) for every parameter at once (4 bytes a parameter). At
1b, 4 x 2048 on one GPU (tests/test_estimate.py holds the numbers) the formula is within
1.5% of the allocator's peak: fp32 and bf16 autocast on an H200, selective and full AC (the
optimizer step, 20N exactly) on an H100. ``python -m tools.saved_census --device cuda`` lists
what one block keeps on a GPU, node by node (on CPU it equals this count to the byte).

The measured band (tests/test_estimate.py, CPU): the formula's activations equal the
tracer's within 1% for fp32, bf16, selective and full AC on one device, 2% under TP; the
peak within -5%/+10% (backward's own temporaries are left out). The bf16 formula is
autocast's; FSDP's MixedPrecisionPolicy (bf16 weights gathered, no autocast) saves less
(no weight copies, one input cast): there it is an upper bound.

FSDP's CPU offload (``Plan.cpu_offload``, train_fsdp.py --cpu-offload): the parameter shards,
their gradients and AdamW's state live on the host (``predict``'s ``"host"``: the 16N/W bytes
above, the gradients unpadded on CUDA, where each shard is copied out of the reduce-scatter's
padded output), and the device's parameters, gradients and optimizer state are 0: what the
device holds is the units gathered while they are in use, their full gradients until they are
reduce-scattered, and the activations. The device's peak is then one of the first four
moments (the optimizer step runs on the host). Not counted: each unit's fp32 shard copied to
the device for its all-gather, and its gradient shard on the device until the copy to the
host (1/W of a unit each, for a moment). On a CPU run the host is the device: the trace sees
both in one memory, and tells them apart by which storages are the sharded state
(common/measure/memory.py, ``offloaded_state``).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace

import torch

from common.model import ModelConfig, Transformer
from common.parallelize.schedules import V_SCHEDULES, schedule_actions

CATEGORIES = ("parameters", "gradients", "optimizer state", "activations")
DP_STRATEGIES = ("single", "ddp", "zero1", "fsdp_zero2", "fsdp_zero3", "hsdp")
STRATEGIES = DP_STRATEGIES + ("tp", "pp", "2d")
STRATEGIES += ("ep",)  # expert parallelism, the dense part FSDP (step3_multi_gpu/train_ep.py)
ALIASES = {"fsdp": "fsdp_zero3", "zero3": "fsdp_zero3", "zero2": "fsdp_zero2", "hsdp_zero3": "hsdp",
           "hsdp_zero2": "hsdp"}
DTYPE_BYTES = {"fp32": 4, "bf16": 2}
COLWISE = ("attention.wq.weight", "attention.wk.weight", "attention.wv.weight", "feed_forward.w1.weight",
           "feed_forward.w3.weight")
ROWWISE = ("attention.wo.weight", "feed_forward.w2.weight")


# ---- shapes and splits -----------------------------------------------------------------------
@functools.lru_cache(maxsize=32)
def _shapes(cfg: ModelConfig) -> tuple[tuple[str, tuple[int, ...]], ...]:
    with torch.device("meta"):
        model = Transformer(cfg)
    return tuple((name, tuple(p.shape)) for name, p in model.named_parameters())


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    return dict(_shapes(cfg))


def _rows(shape) -> tuple[int, int]:
    return shape[0], math.prod(shape[1:])


def shard_numel(shape, w: int, rank: int) -> int:
    """Elements of rank's chunk of a parameter sharded in w along dim 0 (torch.chunk)."""
    rows, rest = _rows(shape)
    chunk = math.ceil(rows / w)
    return max(0, min(chunk, rows - rank * chunk)) * rest


def padded_shard_numel(shape, w: int) -> int:
    rows, rest = _rows(shape)
    return math.ceil(rows / w) * rest


def is_root(name: str) -> bool:
    return not name.startswith("layers.")


def stage_layers(n_layers: int, n_stages: int) -> list[list[int]]:
    """The layer indices each pipeline stage owns: contiguous, sizes differing by at most one.

    When ``n_layers`` does not divide, the *last* ``n_layers % n_stages`` stages get one
    layer more. Why the last: under 1F1B stage s keeps up to (stages - s) micro-batches of
    activations alive, the first stage the most and the last only one, so extra layers
    cost least memory at the end. (The last stage also runs the output projection and the
    loss: cheap with our 256-byte vocabulary, worth about two layers with a 128K one, where
    you would give it fewer layers instead.)
    """
    base, extra = divmod(n_layers, n_stages)
    sizes = [base + (1 if s >= n_stages - extra else 0) for s in range(n_stages)]
    starts = [sum(sizes[:s]) for s in range(n_stages)]
    return [list(range(a, a + n)) for a, n in zip(starts, sizes)]


def stage_shapes(cfg: ModelConfig, stage: int, n_stages: int) -> dict[str, tuple[int, ...]]:
    """The parameters pipeline stage ``stage`` holds (build_stage's pruning, by name)."""
    mine = {f"layers.{i}." for i in stage_layers(cfg.n_layers, n_stages)[stage]}
    keep = {}
    for name, shape in param_shapes(cfg).items():
        if name.startswith("layers."):
            ok = name[: name.index(".", 7) + 1] in mine
        elif name.startswith("tok_embeddings."):
            ok = stage == 0
        else:  # norm, output
            ok = stage == n_stages - 1
        if ok:
            keep[name] = shape
    return keep


def tp_shapes(shapes: dict[str, tuple[int, ...]], tp: int) -> dict[str, tuple[int, ...]]:
    """Each parameter's local shape under common/parallelize/tp.py:apply_tp (even splits)."""
    if tp == 1:
        return dict(shapes)
    out = {}
    for name, (a, *rest) in shapes.items():
        if name.endswith(COLWISE) or name in ("output.weight", "tok_embeddings.weight"):
            out[name] = (a // tp, *rest)  # split by output rows (the embedding: by vocabulary)
        elif name.endswith(ROWWISE):
            out[name] = (a, rest[0] // tp)
        else:
            out[name] = (a, *rest)  # norms: replicated
    return out


# ---- model state ----------------------------------------------------------------------------
def _state(dp_kind: str, shapes: dict, dp: int, rank: int, adam_step_bytes: int = 4) -> dict[str, int]:
    n, t = sum(math.prod(s) for s in shapes.values()), len(shapes)
    if dp_kind in ("single", "ddp"):
        return {"parameters": 4 * n, "gradients": 4 * n, "optimizer state": 8 * n + adam_step_bytes * t}
    if dp_kind == "zero1":
        return {"parameters": 4 * n, "gradients": 4 * n,
                "optimizer state": round((8 * n + adam_step_bytes * t) / dp)}
    padded = sum(padded_shard_numel(sh, dp) for sh in shapes.values())
    local = sum(shard_numel(sh, dp, rank) for sh in shapes.values())
    return {"parameters": 4 * padded, "gradients": 4 * padded, "optimizer state": 8 * local + adam_step_bytes * t}


def model_state(strategy: str, cfg: ModelConfig, world: int, rank: int = 0, shard: int | None = None,
                adam_step_bytes: int = 4) -> dict[str, int]:
    """Predicted bytes of parameters, gradients and AdamW state on one rank at the
    optimizer step, for the data-parallel family (``shard``: the FSDP shard group size,
    the world size by default; ZeRO-1's partition is ZeroRedundancyOptimizer's own, so
    its state is the average)."""
    strategy = ALIASES.get(strategy, strategy)
    s = shard or world
    kind = "fsdp" if strategy.startswith(("fsdp", "hsdp")) else strategy
    return _state(kind, param_shapes(cfg), world if kind == "zero1" else s,
                  rank % s, adam_step_bytes)  # HSDP: ranks are (replicate, shard), shard index fastest


def ckpt_staging_bytes(strategy: str, cfg: ModelConfig, world: int, rank: int = 0, shard: int | None = None) -> int:
    """--ckpt-async: the host memory one rank's checkpoint copy takes while it is written.

    DCP's stager copies every tensor of the rank's state dict: the fp32 weights it holds
    (all of them under DDP and ZeRO-1, its unpadded shard under FSDP) and the AdamW state it
    holds (moments and 4-byte step counts). Under DDP that is 12N + 4 bytes per parameter
    tensor on *every* rank, although the files hold one copy (each replica writes a part).
    On a GPU this is host memory beside the GPU's; on a CPU it is a second copy of the state
    in the same memory, alive from one checkpoint step until its write ends, which the memory
    trace counts as "checkpoint staging" (tests/test_checkpoint.py: exactly these bytes)."""
    strategy = ALIASES.get(strategy, strategy)
    kind = "fsdp" if strategy.startswith(("fsdp", "hsdp")) else strategy
    s = shard or world
    shapes = param_shapes(cfg)
    state = model_state(strategy, cfg, world, rank, shard)
    weights = 4 * (sum(shard_numel(sh, s, rank % s) for sh in shapes.values()) if kind == "fsdp"
                   else sum(math.prod(sh) for sh in shapes.values()))
    return weights + state["optimizer state"]


def unsharded_bytes(cfg: ModelConfig, world: int = 1, bytes_per_param: int = 4) -> dict[str, int]:
    """Gathered size of each FSDP unit, 'root' and one 'block' (padded chunks x world)."""
    shapes = param_shapes(cfg)
    root = sum(padded_shard_numel(s, world) * world for k, s in shapes.items() if is_root(k))
    block = sum(padded_shard_numel(s, world) * world for k, s in shapes.items() if k.startswith("layers.0."))
    return {"root": bytes_per_param * root, "block": bytes_per_param * block}


# ---- communication ---------------------------------------------------------------------------
def _dp_comm(strategy: str, shapes: dict, world: int, shard: int | None, param_bytes: int, accum: int,
             split_root: bool = False):
    n = sum(math.prod(s) for s in shapes.values())
    if strategy in ("single",) or world == 1:
        return {}
    if strategy == "ddp":
        return {"all_reduce": 4 * n}
    if strategy == "zero1":
        return {"all_reduce": 4 * n, "broadcast": 4 * n}
    s = shard or world
    if s == 1:  # nothing sharded: HSDP degenerates into DDP
        return {"all_reduce": 4 * n}
    gathered = {k: padded_shard_numel(sh, s) * s for k, sh in shapes.items()}  # padded full size
    full = sum(gathered.values())
    no_root = sum(v for k, v in gathered.items() if not is_root(k))
    if split_root:  # --split-root-unit: the embedding's unit is gathered again for backward, as a block's is
        no_root += sum(v for k, v in gathered.items() if k.startswith("tok_embeddings."))
    out = {"all_gather": accum * param_bytes * (full + (no_root if strategy.endswith("zero3") else 0)),
           "reduce_scatter": 4 * full,
           # clipping: PyTorch reduces one fp32 norm per sharded tensor, in one all-reduce
           # (a few more where shards are uneven; this is the even case)
           "all_reduce (grad norm)": 4 * len(shapes)}
    if strategy.startswith("hsdp") and world > s:
        out["all_reduce"] = 4 * full // s  # each rank's reduced shard, across the replicas
    return out


def comm_bytes(strategy: str, cfg: ModelConfig, world: int, shard: int | None = None,
               param_bytes: int = 4, accum: int = 1) -> dict[str, int]:
    """Logical bytes per rank per optimizer step, by collective (``param_bytes`` 2 for
    bf16 all-gathers; gradients are always reduced in fp32). With ``accum`` micro-batches
    the gradients are still reduced once, but FSDP gathers the parameters for each."""
    strategy = ALIASES.get(strategy, strategy)
    if strategy == "hsdp":
        strategy = "hsdp_zero3"
    return _dp_comm(strategy, param_shapes(cfg), world, shard, param_bytes, accum)


def tp_bytes_per_step(cfg: ModelConfig, batch: int, seq_len: int, sequence_parallel: bool,
                      bytes_per_el: int = 4, embedding_bytes_per_el: int | None = None,
                      recomputed_blocks: int = 0) -> dict[str, int]:
    """The activation traffic of common/parallelize/tp.py:apply_tp, logical bytes per step.

    Each collective moves one (batch, seq, dim) activation. Per block: 2 all-reduces in
    forward (after wo, after w2) and 2 in backward (the input gradients of the q/k/v and
    w1/w3 groups). Outside the blocks: the embedding's output in forward and the output
    projection's input gradient in backward. So 4L + 2 all-reduces.

    With sequence parallelism each of them becomes a reduce-scatter on one side and an
    all-gather on the other (forward: reduce-scatter after wo/w2 and the embedding,
    all-gather before attention, the MLP and the output; backward: the mirror image):
    4L + 2 of each, and since a ring all-reduce *is* a reduce-scatter followed by an
    all-gather, exactly the same bytes on the wire.

    Small extras not counted here: with SP the norm gains' gradients (all-reduced, 4 bytes
    x dim each); loss parallelism's per-token statistics (the byte counter does not see
    collectives issued inside DTensor's own operator implementations).

    ``bytes_per_el``: the compute dtype's (2 under bf16). ``embedding_bytes_per_el``: the
    embedding's output, which autocast leaves in fp32 (an embedding is a lookup, not a
    matmul) while FSDP's bf16 parameters make it bf16 (default: ``bytes_per_el``).

    ``recomputed_blocks``: blocks under activation checkpointing (full or selective) run
    their forward again in backward, collectives included, up to the last tensor backward
    needs: the attention's all-reduce (after wo) but not the MLP's, whose output nothing
    saves; with SP both all-gathers (before attention and MLP) and the reduce-scatter
    after wo. Measured: exactly these, for both AC modes.
    """
    tokens = batch * seq_len * cfg.dim
    first = tokens * (embedding_bytes_per_el or bytes_per_el)
    total = (4 * cfg.n_layers + 1) * tokens * bytes_per_el + first
    again = recomputed_blocks * tokens * bytes_per_el
    if sequence_parallel:
        return {"all_gather": total + 2 * again, "reduce_scatter": total + again}
    return {"all_reduce": total + again}


def pp_bytes_per_step(cfg: ModelConfig, batch: int, seq_len: int, pp: int, rank: int, loops: int = 1,
                      bytes_per_el: int = 4, v: bool = False) -> dict[str, int]:
    """Point-to-point bytes of pipeline rank ``rank`` per step: the whole batch crosses each
    stage boundary once forward (activations) and once backward (their gradients). A rank
    with ``loops`` stages (interleaved) has that many boundaries each way, less the ends.
    In a V (``v``) the turn (stages p-1 and p) sits on the last rank and stages 0 and 2p-1
    on the first, so the end ranks pass one activation each way and the middle ones two."""
    act = batch * seq_len * cfg.dim * bytes_per_el
    boundaries = (loops - (rank == pp - 1)) + (loops - (rank == 0))
    if v:
        boundaries = 2 * (2 - (rank == 0) - (rank == pp - 1))
    return {"send": boundaries * act, "recv": boundaries * act} if pp > 1 else {}


# ---- activations ----------------------------------------------------------------------------
def layer_activation_bytes(cfg: ModelConfig, tokens: int, dtype: str = "fp32", ac: str = "none", tp: int = 1,
                           sequence_parallel: bool = False, device: str = "cpu", mp_policy: bool = False) -> int:
    """Bytes one block keeps for backward, for ``tokens`` tokens on one rank (see the module notes).

    ``device`` picks whose kernels: on CUDA the fused RMSNorm keeps its input and 1/rms but
    not the normalised x (the CPU's composite norm keeps it: 4 bytes x d, twice a block), and
    in fp32 with grouped-query attention the model copies k and v to every query head before
    attention (common/model.py: CUDA's fp32 kernel has no GQA), so attention saves k and v at
    the width of q, d, instead of kv. ``mp_policy``: bf16 under FSDP's mixed-precision policy
    instead of autocast: the residual stream is bf16, so a checkpointed block's input is 2
    bytes a value, not 4 (without AC the count stays autocast's, an upper bound).
    """
    d, f, h, kv = cfg.dim, cfg.ffn_dim, cfg.n_heads, cfg.n_kv_heads * cfg.head_dim
    b = 4 if dtype == "fp32" else 2
    stream = 2 if mp_policy and dtype != "fp32" else 4  # the residual stream's bytes a value
    if ac == "full":
        return stream * d * tokens // (tp if sequence_parallel else 1)
    if ac in ("selective", "selective-op"):
        # common/parallelize/ac.py keeps the block input (the checkpoint's argument, fp32 residual
        # stream) and the outputs of the matmuls and of attention; everything else is recomputed.
        # Sharded over heads and MLP units: wq, wk, wv (kv: before any GQA copy, which is
        # recomputed), attention's output and log-sum-exp, w1, w3. Full width on every TP rank:
        # wo's and w2's local products (partial sums, reduced after the matmul).
        replicated, sharded = b * 2 * d, b * (2 * d + 2 * kv + 2 * f) + 4 * h
        if ac == "selective-op":  # every second matmul recomputed: wq, wv, w1 and w2 kept, wk, wo, w3 not
            replicated, sharded = b * d, b * (2 * d + kv + f) + 4 * h
        block_input = stream * d // (tp if sequence_parallel else 1)
        return tokens * (block_input + replicated + sharded // tp)
    # CUDA path: the formula for CUDA's kernels, computed on any machine:
    # tests/test_estimate.py::test_where_the_1b_peaks_fall_and_what_is_device_specific
    if device == "cuda" and dtype == "fp32":
        kv = d  # the k and v attention saves: copied to every query head (no change without GQA)
    if dtype == "fp32":
        # replicated: the norms' inputs, normalised x, outputs and 1/rms; sharded over
        # heads and MLP units: q, attention's output, k, v, the MLP's four, lse
        replicated, sharded = 4 * (6 * d + 2), 4 * (2 * d + 2 * kv + h + 4 * f)
        if sequence_parallel:  # x, 1/rms and normalised x split along the sequence; the norm's output gathered
            replicated, sharded = 4 * 2 * d, sharded + 4 * (4 * d + 2)
    else:  # torch.autocast bf16
        # replicated: the fp32 block input, normalised x (twice) and residual (16d), the
        # norms' 1/rms (8) and their outputs' bf16 copies (2 x 2d); sharded: q and
        # attention's output (2 x 2d), k and v (2 x 2kv), lse (4h), the MLP's four (8f)
        replicated, sharded = 20 * d + 8, 4 * d + 4 * kv + 4 * h + 8 * f
        if sequence_parallel:  # the norms' bf16 outputs gathered; the rest split along the sequence
            replicated, sharded = 4 * d, sharded + 16 * d + 8
    # CUDA path: tests/test_estimate.py::test_cuda_kernels_keep_what_the_census_on_the_h200_listed
    if device == "cuda":  # the fused RMSNorm keeps no normalised x (fp32, both norms)
        if sequence_parallel:
            sharded -= 8 * d
        else:
            replicated -= 8 * d
    return tokens * (replicated + sharded // tp)


def head_activation_bytes(cfg: ModelConfig, tokens: int, dtype: str = "fp32", tp: int = 1,
                          loss_parallel: bool = True, sequence_parallel: bool = False,
                          fp32_logits: bool = False, head_loss: bool = False, loss_chunks: int = 1) -> int:
    """The final norm, the logits and cross entropy's log-probabilities (last stage only).
    ``fp32_logits``: bf16 compute that hands the loss fp32 logits (FSDP's root policy,
    output_dtype fp32: the bf16 matmul output dies in the cast, its fp32 copy is kept).
    ``head_loss``: the model computes the loss itself (``model(x, targets=y)``), so nothing
    holds the logits: only the log-probabilities stay (4 bytes a vocabulary entry), and with
    ``loss_chunks`` > 1 not even those (common/loss.py keeps only the output layer's input,
    the norm's output, counted here already)."""
    d, v = cfg.dim, cfg.vocab_size // (tp if loss_parallel else 1)
    norm = 12 * d + 4 if dtype == "fp32" else 10 * d + 4
    if sequence_parallel:
        norm = (norm - 4 * d) // tp + 4 * d
    if head_loss:
        return tokens * (norm + (4 * v if loss_chunks <= 1 else 0))
    logits = (4 if dtype == "fp32" or fp32_logits else 2) * v
    return tokens * (norm + logits + 4 * v)


def loss_backward_bytes(cfg: ModelConfig, tokens: int, dtype: str, loss_chunks: int = 1, tp: int = 1,
                        weight_bytes: int = 4) -> int:
    """What the loss's backward holds at once beyond the activations: the plain loss two fp32
    (tokens, vocab) gradients (of the log-probabilities and of the logits); the chunked one
    (common/loss.py) one chunk's logits and their softmax (fp32: 8 bytes an entry), the
    output layer's whole gradient (``weight_bytes`` a value) and the gradient of its input."""
    v = cfg.vocab_size // tp
    if loss_chunks <= 1:
        return 8 * v * tokens
    chunk = -(-tokens // loss_chunks)
    return 8 * v * chunk + weight_bytes * v * cfg.dim + DTYPE_BYTES[dtype] * tokens * cfg.dim


def amp_weight_copies(shapes: dict) -> int:
    """autocast's bf16 copy of each weight matrix, saved by the matmuls that use it."""
    return sum(2 * math.prod(s) for k, s in shapes.items() if k.endswith("weight") and "norm" not in k
               and not k.startswith("tok_embeddings"))


def checkpointed_blocks(n_layers: int, ac: str, every: int = 1) -> int:
    """How many of ``n_layers`` blocks apply_ac checkpoints (blocks 0, k, 2k, ...)."""
    return 0 if ac == "none" else -(-n_layers // every)


# ---- a whole configuration ---------------------------------------------------------------------
@dataclass
class Plan:
    """One training configuration: model, strategy, degrees, batch (global, in sequences)."""
    cfg: ModelConfig
    strategy: str = "single"
    world: int = 1
    tp: int = 1
    pp: int = 1
    shard: int | None = None          # HSDP's shard group size
    batch: int = 8
    seq_len: int = 256
    dtype: str = "fp32"
    ac: str = "none"
    ac_every: int = 1                 # checkpoint every k-th block (common/parallelize/ac.py:apply_ac)
    accum: int = 1
    microbatches: int | None = None   # pipeline micro-batches (default: pp)
    schedule: str = "1f1b"
    sequence_parallel: bool = False
    loss_parallel: bool = True
    device: str = "cpu"               # whose kernels: "cpu" or "cuda" (attention's saved k/v)
    optimizer: str | None = None      # AdamW's kernels: foreach, fused or for-loop (None: the device's default)
    ep: int | None = None             # expert-parallel degree (strategy "ep"; default: the world size)
    notes: list = field(default_factory=list)
    cp: int | None = None             # context-parallel degree (strategies cp, cp_fsdp; default: the world size)
    loss_chunks: int = 1              # --loss-chunks: the output layer and the loss in chunks of tokens
    head_loss: bool | None = None     # the loss is the model's own (model(x, targets=y): train_ddp.py and
                                      # train_fsdp.py), holding no logits; None: from the strategy
    split_root: bool = False          # --split-root-unit: embedding and head in FSDP units of their own
    cpu_offload: bool = False         # --cpu-offload: FSDP's shards, gradients and AdamW state on the host

    def __post_init__(self):
        self.strategy = ALIASES.get(self.strategy, self.strategy)
        if self.dtype == "fp16":  # autocast to fp16 keeps the same 2-byte copies as bf16
            self.dtype = "bf16"
        if self.strategy == "tp" and self.tp == 1:
            self.tp = self.world
        if self.strategy == "pp" and self.pp == 1:
            self.pp = self.world
        if self.head_loss is None:
            self.head_loss = self.strategy in HEAD_LOSS_STRATEGIES
        if self.cpu_offload and not self.strategy.startswith(("fsdp", "hsdp")):
            raise ValueError(f"cpu_offload is FSDP's (train_fsdp.py --cpu-offload), not {self.strategy}'s")
        if self.optimizer is None:  # what torch.optim picks when told neither foreach nor fused
            # CUDA path: tests/test_estimate.py::test_where_the_1b_peaks_fall_and_what_is_device_specific
            self.optimizer = "foreach" if self.device == "cuda" else "for-loop"

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp)

    @property
    def dp_kind(self) -> str:
        """How the data-parallel dimension treats the model state."""
        if self.strategy in ("2d", "ep"):  # ep: experts split like FSDP's shards, but never gathered
            return "fsdp_zero3"
        if self.strategy in ("tp", "pp"):
            return "ddp" if self.dp > 1 else "single"
        return self.strategy

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp stage, dp index, tp index): tp varies fastest, then dp (train_2d's mesh)."""
        return rank // (self.dp * self.tp), rank // self.tp % self.dp, rank % self.tp


# the layouts whose scripts ask the model for the loss (model(x, targets=y)) instead of holding logits
HEAD_LOSS_STRATEGIES = ("ddp", "zero1", "fsdp_zero2", "fsdp_zero3", "hsdp")


def _loops(plan: Plan) -> int:
    return 2 if plan.schedule in ("interleaved1f1b", *V_SCHEDULES) and plan.pp > 1 else 1


def _rank_stages(plan: Plan, stage: int) -> list[int]:
    """The pipeline stages of the rank at position ``stage``: looped (s, s + p) or in a V (s, 2p - 1 - s)."""
    if plan.schedule in V_SCHEDULES and plan.pp > 1:
        return [stage, 2 * plan.pp - 1 - stage]
    return [stage + k * plan.pp for k in range(_loops(plan))]


def rank_shapes(plan: Plan, rank: int) -> dict[str, tuple[int, ...]]:
    stage, _, _ = plan.coords(rank)
    loops = _loops(plan)
    shapes = {}
    for s in _rank_stages(plan, stage):
        shapes |= stage_shapes(plan.cfg, s, plan.pp * loops)
    return tp_shapes(shapes, plan.tp)


def v_live_peak(plan: Plan, rank_stage: int, bytes_per_microbatch: dict[int, float]) -> float:
    """The most a V-schedule rank holds at once of ``bytes_per_microbatch[stage]`` per live
    micro-batch of each of its two stages. A micro-batch's activations on a stage live from
    its forward ("F") to the end of its backward: the full backward ("B") or, where the
    schedule splits it, the weight half ("W"), which still needs the layers' saved inputs
    after the input half ("I") has passed the gradient on. Counted along the order PyTorch's
    schedule runs (common/parallelize/schedules.py:schedule_actions)."""
    m = plan.microbatches or plan.pp
    try:
        actions = schedule_actions(plan.schedule, plan.pp, m)[rank_stage]
    except (AttributeError, TypeError, ValueError):  # a PyTorch whose schedule builds its lists otherwise:
        # ZBV's counts (the first-leg stage holds up to 2p - r micro-batches, the return stage r)
        first, back = sorted(bytes_per_microbatch)
        return min(m, 2 * plan.pp - rank_stage) * bytes_per_microbatch[first] + \
            min(m, rank_stage) * bytes_per_microbatch[back]
    live = dict.fromkeys(bytes_per_microbatch, 0)
    peak = 0.0
    for kind, s, _ in actions:
        live[s] += {"F": 1, "B": -1, "W": -1}.get(kind, 0)
        peak = max(peak, sum(n * bytes_per_microbatch[k] for k, n in live.items()))
    return peak


def _peak(plan: Plan, kind: str, fsdp: bool, out: dict, transient: dict) -> tuple[int, str, int]:
    """The step's peak: the largest of five moments.

    - end of forward: parameters, AdamW state, every activation and autocast's cache of
      bf16 weight copies (alive until the loss is computed, see ``predict``). The gradients
      are not there yet when the previous step freed them (``zero_grad(set_to_none=True)``
      with one micro-batch and no DDP); DDP keeps its gradient buckets, accumulation and
      pipelines keep the gradients of the earlier micro-batches.
    - the loss's backward: the same less the cache, with FSDP's root (or head) unit and one
      block gathered, plus the loss's gradients (``loss_backward_bytes``): the peak of a
      large vocabulary's plain loss;
    - start of backward: the same less the cache, plus one block rebuilt by checkpointing;
    - end of backward: every gradient, and the first block rebuilt (what matters under full
      AC, where the activations are small and the gradients are not);
    - the optimizer step: parameters, gradients, AdamW state and its temporaries. On CUDA
      AdamW defaults to the foreach kernels, which build sqrt(v) for every parameter at once
      (4 bytes a parameter: half the state); on CPU it updates one tensor at a time, and
      ``--fused-adamw`` runs one kernel that holds none (``plan.optimizer``).
    FSDP's gathered weights and unsharded gradients count at the first two.
    Returns (peak, which moment, the optimizer's temporaries).
    """
    state_bytes = out["optimizer state"]
    grads_live = kind in ("ddp", "zero1") or plan.accum > 1 or plan.pp > 1
    base = out["parameters"] + state_bytes + out["activations"] + (out["gradients"] if grads_live else 0)
    base += sum(v for k, v in transient.items() if "FSDP" in k)
    cache = sum(v for k, v in transient.items() if k.startswith("autocast"))
    rebuilt = sum(v for k, v in transient.items() if "recomputed" in k)
    loss = sum(v for k, v in transient.items() if k.startswith(LOSS_BACKWARD))
    at_loss = base - sum(v for k, v in transient.items() if "FSDP" in k) + out.get("FSDP at the loss", 0)
    # half the state: one fp32 value a parameter (the few bytes of step counters aside)
    temporaries = state_bytes // 2 if plan.optimizer == "foreach" else 0
    full = out["parameters"] + out["gradients"] + state_bytes
    moments = {"end of forward": base + cache, "loss backward": at_loss + loss, "start of backward": base + rebuilt,
               "end of backward": max(full + rebuilt + sum(v for k, v in transient.items() if "FSDP" in k),
                                      out["parameters"] + state_bytes + sum(out.get(ROOT_REDUCE, {}).values())),
               "optimizer step": full + temporaries}
    at = max(moments, key=moments.get)
    return moments[at], at, temporaries


def offloaded_state(plan: Plan, shapes: dict, shard: int, index: int, out: dict) -> dict[str, int]:
    """FSDP's CPU offload: this rank's parameters, gradients and AdamW state, taken out of
    ``out`` (the device's, now 0) and returned as the host's. The parameter shards are
    materialised padded on the host; a gradient shard is a view of the reduce-scatter's padded
    output where that output is already host memory (a CPU run), and an unpadded copy of it on
    CUDA (FSDP2 copies ``sharded_size`` elements to the host, one tensor per parameter)."""
    host = {c: out[c] for c in ("parameters", "gradients", "optimizer state")}
    # CUDA path: tests/test_estimate.py::test_cpu_offload_puts_the_sharded_state_on_the_host
    if plan.device == "cuda":
        host["gradients"] = 4 * sum(shard_numel(s, shard, index) for s in shapes.values())
    out |= dict.fromkeys(host, 0)
    return host


ROOT_REDUCE = "FSDP root unit's reduce-scatter"
LOSS_BACKWARD = "the loss's backward"


def _root_reduce(plan: Plan, shapes: dict, shard: int, grads: int, tokens: int) -> dict[str, int]:
    """The last moment of an FSDP backward, less the parameter shards and AdamW state: the
    root unit (embedding, final norm, output layer) is the last to be reduce-scattered.
    Its gathered weights are freed by then (FSDP reshards a unit before reducing it), but
    its full-size gradients (in the compute dtype) and their copy into the reduce-scatter
    buffer (fp32, the reduce dtype) are alive together, beside every other unit's gradient
    shard and the logits the script still holds (fp32: the root's output dtype). Small with
    a byte vocabulary; with a 128K one the root is larger than any block (measured at 1b,
    rank 0 of 8: 0.98 GiB of bf16 gradients and a 1.96 GiB buffer at the peak)."""
    root = {k: s for k, s in shapes.items() if is_root(k) and not (plan.split_root and not k.startswith(
        "tok_embeddings."))}  # --split-root-unit: the embedding's unit is the last to reduce
    if not root:
        return {}
    full = sum(padded_shard_numel(s, shard) * shard for s in root.values())
    own = 4 * sum(padded_shard_numel(s, shard) for s in root.values())
    return {"other units' gradient shards": grads - own,
            f"root's full gradients ({plan.dtype})": DTYPE_BYTES[plan.dtype] * full,
            "root's fp32 reduce-scatter copy": 4 * full,
            "logits still held (fp32)": 4 * tokens * (plan.cfg.vocab_size // plan.tp)
            if "output.weight" in root and not plan.head_loss else 0}


def _v_activations(plan: Plan, stage: int, tokens: int) -> tuple[int, int]:
    """A V-schedule rank's activations at their peak, and the most micro-batch-stages alive then
    (each stage's forward casts its own bf16 RoPE tables): each stage's blocks (checkpointed
    from its own first block) and, on the last stage, the head, weighted by its live micro-batches."""
    cfg, n_stages = plan.cfg, 2 * plan.pp
    per_mb = {}
    for s in _rank_stages(plan, stage):
        n = len(stage_layers(cfg.n_layers, n_stages)[s])
        k = checkpointed_blocks(n, plan.ac, plan.ac_every)
        per_mb[s] = sum(c * layer_activation_bytes(cfg, tokens, plan.dtype, ac, plan.tp, plan.sequence_parallel,
                                                   plan.device) for c, ac in ((k, plan.ac), (n - k, "none")) if c)
        if s == n_stages - 1:
            per_mb[s] += head_activation_bytes(cfg, tokens, plan.dtype, plan.tp, plan.loss_parallel,
                                               plan.sequence_parallel)
    return int(v_live_peak(plan, stage, per_mb)), int(v_live_peak(plan, stage, dict.fromkeys(per_mb, 1)))


def predict(plan: Plan, rank: int = 0) -> dict:
    """Per-rank bytes by category, the transient extras at the peak, and bytes sent per step."""
    if plan.strategy in ("cp", "cp_fsdp"):
        return cp_predict(plan, rank)
    cfg, kind = plan.cfg, plan.dp_kind
    stage, dp_index, _ = plan.coords(rank)
    shapes = rank_shapes(plan, rank)
    fsdp = kind.startswith(("fsdp", "hsdp"))
    shard = (plan.shard or plan.dp) if fsdp else plan.dp
    out = _state("fsdp" if fsdp else kind, shapes, shard, dp_index % shard if fsdp else dp_index)

    # activations: one micro-batch's tokens per rank, times the micro-batches kept alive
    loops = _loops(plan)
    m = plan.microbatches or plan.pp
    seqs = plan.batch // plan.dp // plan.accum // (m if plan.pp > 1 else 1)
    tokens = seqs * plan.seq_len
    in_flight = 1 if plan.pp == 1 else m if plan.schedule == "gpipe" else min(m, plan.pp - stage + (loops - 1) * plan.pp)
    n_layers = sum(1 for k in shapes if k.endswith("attention_norm.weight"))
    # apply_ac checkpoints the blocks whose position in model.layers is a multiple of ac_every
    # (a pipeline stage counts its own blocks from 0); the others keep everything
    checkpointed = checkpointed_blocks(n_layers, plan.ac, plan.ac_every)
    # FSDP's bf16 is its mixed-precision policy (no autocast) but under 2-D, where autocast stays
    mp_policy = fsdp and plan.strategy != "2d" and plan.dp > 1
    act = sum(k * layer_activation_bytes(cfg, tokens, plan.dtype, ac, plan.tp, plan.sequence_parallel, plan.device,
                                         mp_policy)
              for k, ac in ((checkpointed, plan.ac), (n_layers - checkpointed, "none")) if k)
    if "output.weight" in shapes:
        act += head_activation_bytes(cfg, tokens, plan.dtype, plan.tp, plan.loss_parallel, plan.sequence_parallel,
                                     fp32_logits=plan.strategy.startswith(("fsdp", "hsdp")),
                                     head_loss=plan.head_loss, loss_chunks=plan.loss_chunks)
    act *= in_flight
    if plan.schedule in V_SCHEDULES and plan.pp > 1:  # two stages whose micro-batches come and go apart
        act, in_flight = _v_activations(plan, stage, tokens)
    act += 16 * (plan.batch // plan.dp // plan.accum) * plan.seq_len  # the batch's x and y, int64
    transient = {}
    if plan.dtype == "bf16":
        if not fsdp:  # FSDP's bf16 gathers bf16 weights (a transient below) instead of autocast's copies
            # autocast caches one bf16 copy of each weight until the autocast region ends (after
            # the loss). Matmuls outside a checkpoint save theirs for backward: activations. A
            # checkpointed block's matmuls save nothing, so its copies die when the cache is
            # cleared: at the end of forward they are still there (a transient), in backward
            # they are cast again one block at a time.
            copies = amp_weight_copies(shapes)
            blocks = sorted({int(k.split(".")[1]) for k in shapes if k.startswith("layers.")})
            ckpt = {f"layers.{b}." for i, b in enumerate(blocks) if plan.ac != "none" and i % plan.ac_every == 0}
            kept = amp_weight_copies({k: v for k, v in shapes.items() if not k.startswith(tuple(ckpt) or "\0")})
            # A pipeline stage's forward is its own autocast region (the schedule calls it, so
            # autocast sits on the forward): each micro-batch in flight keeps its own copies,
            # as it keeps its own RoPE tables below (a V rank's micro-batch-stage: about half
            # of the rank's weights). Measured against dry runs of 1F1B and GPipe ranks.
            act += kept * in_flight // (2 if plan.schedule in V_SCHEDULES and plan.pp > 1 else 1)
            if copies > kept:
                transient["autocast weight copies (until the loss)"] = copies - kept
        if n_layers:  # the RoPE tables, cast to bf16 once per forward (whole, max_seq_len rows)
            act += in_flight * 4 * cfg.max_seq_len * cfg.head_dim
    if plan.strategy == "ep":
        out = ep_state(plan, shapes, rank)
    if cfg.n_experts:
        act += moe_activation_extra(plan, tokens, n_layers, shapes)
    out["activations"] = act

    # what comes and goes during the step, on top of the above
    block = {k: v for k, v in shapes.items() if k.startswith("layers.") and k.split(".")[1] == str(
        min(int(x.split(".")[1]) for x in shapes if x.startswith("layers.")))} if n_layers else {}
    block_n = sum(math.prod(s) for k, s in block.items() if not (plan.strategy == "ep" and is_expert(k)))
    if fsdp and plan.dp > 1:
        pbytes = DTYPE_BYTES[plan.dtype]
        if kind.endswith("zero2"):
            gathered = sum(math.prod(s) for s in shapes.values())
        elif plan.split_root:  # the head's unit stays gathered from its forward to its backward; a block, and
            # the next one prefetched (the embedding's unit is gathered only around its own forward and backward)
            gathered = sum(math.prod(s) for k, s in shapes.items() if is_root(k) and not k.startswith(
                "tok_embeddings.")) + 2 * block_n
        else:  # the root stays gathered; a block, and the next one prefetched
            gathered = sum(math.prod(s) for k, s in shapes.items() if is_root(k)) + 2 * block_n
        transient["gathered parameters (FSDP" + (", head in its own unit)" if plan.split_root else ")")] = \
            pbytes * gathered
        # a block's full gradients in the compute dtype and their fp32 copy in the
        # reduce-scatter buffer, alive together while FSDP reduces it (see _root_reduce)
        transient["unsharded gradients (FSDP)"] = (pbytes + 4) * block_n
        # when the loss's backward runs, no block's gradient exists yet and one block is gathered
        # (backward's prefetch of the last), not two
        out["FSDP at the loss"] = pbytes * (gathered - (block_n if not kind.endswith("zero2") else 0))
        if root := _root_reduce(plan, shapes, shard, out["gradients"], tokens):
            out[ROOT_REDUCE] = root
    if plan.cpu_offload:
        out["host"] = offloaded_state(plan, shapes, shard, dp_index % shard, out)
        if ROOT_REDUCE in out:  # by the root's reduce-scatter the other units' shards are on the host
            out[ROOT_REDUCE]["other units' gradient shards"] = 0
    if plan.ac in ("full", "selective", "selective-op") and n_layers:
        # backward rebuilds one block at a time: all of it (full), or what selective AC dropped
        rebuilt = layer_activation_bytes(cfg, tokens, plan.dtype, "none", plan.tp, plan.sequence_parallel, plan.device)
        if plan.ac != "full":
            rebuilt -= layer_activation_bytes(cfg, tokens, plan.dtype, plan.ac, plan.tp, plan.sequence_parallel)
        transient[f"one block recomputed ({plan.ac} AC)"] = rebuilt
    if "output.weight" in shapes:  # the loss's backward, on the last stage
        what = "plain" if plan.loss_chunks <= 1 else f"in {plan.loss_chunks} chunks"
        transient[f"{LOSS_BACKWARD} ({what})"] = loss_backward_bytes(
            cfg, tokens, plan.dtype, plan.loss_chunks, plan.tp if plan.loss_parallel else 1,
            DTYPE_BYTES[plan.dtype] if mp_policy else 4)
    out["transient"] = transient
    out["peak"], out["peak_at"], out["optimizer temporaries"] = _peak(plan, kind, fsdp, out, transient)

    comm = {}
    if plan.dp > 1:
        dp_strategy = {"single": "ddp", "hsdp": "hsdp_zero3"}.get(kind, kind)
        comm |= _dp_comm(dp_strategy, shapes, plan.dp, plan.shard if kind == "hsdp" else None,
                         DTYPE_BYTES[plan.dtype] if fsdp else 4, plan.accum, plan.split_root)
    if plan.tp > 1:
        stage_cfg = replace(cfg, n_layers=n_layers)
        for k, v in tp_bytes_per_step(stage_cfg, plan.batch // plan.dp, plan.seq_len, plan.sequence_parallel,
                                      # the embedding's output: bf16 only where FSDP's policy casts the
                                      # parameters (dp > 1; apply_fsdp falls back to autocast otherwise)
                                      DTYPE_BYTES[plan.dtype], None if fsdp and plan.dp > 1 else 4,
                                      checkpointed).items():
            comm[k] = comm.get(k, 0) + v
    if plan.pp > 1:
        # the residual stream crosses the stages: fp32 under autocast and out of FSDP's root
        comm |= pp_bytes_per_step(cfg, plan.batch // plan.dp, plan.seq_len, plan.pp, stage, loops,
                                  v=plan.schedule in V_SCHEDULES)
    if plan.strategy == "ep":
        comm = ep_comm(plan, shapes, tokens)
    out["comm"] = comm
    return out


# ---- prediction beside measurement, at the end of a training run -------------------------------
def report(args, ctx, memory, strategy: str, lines: list | None = None, **plan_kwargs) -> dict | None:
    """Print 'predicted vs measured' per category on rank 0 (into ``lines`` instead, when
    given: Run prints them after the run's own table); return it for summary.json.

    ``memory``: tracer.save's per-rank results (None when not traced: prediction only).
    Model state is compared when the optimizer step begins (everything is allocated and
    nothing transient is left), activations at their peak. Under FSDP's CPU offload the
    device's categories and peak are the trace's less the offloaded state, which is compared
    apart as the host's (on a CPU run the trace holds both: common/measure/memory.py).
    """
    if not ctx.is_main:
        return None
    from common.measure.memory import STAGING, fmt_bytes
    # CUDA path: no CPU test: which kernels' formula a run is held to follows its device; gpu_check holds CUDA
    # runs to it
    plan_kwargs.setdefault("device", "cuda" if ctx.device.type == "cuda" else "cpu")
    plan = Plan(args.model_config, strategy, world=ctx.world_size, batch=args.global_batch_size,
                seq_len=args.seq_len, **plan_kwargs)
    ranks = [m["rank"] for m in memory] if memory else [0]
    out = {"strategy": plan.strategy, "dtype": plan.dtype, "ac": plan.ac, "device": plan.device, "per_rank": []}
    say = lines.append if lines is not None else (lambda line: print(line, flush=True))
    say(f"  predicted (common/measure/theory.py) vs measured, {plan.strategy}:")
    for r in ranks:
        p = predict(plan, r)
        m = next((x for x in memory or [] if x["rank"] == r), None)
        row = {"rank": r, **{c: p[c] for c in CATEGORIES}, "peak": p["peak"], "peak_at": p["peak_at"], "comm": p["comm"]}
        cells = []
        off = (m or {}).get("offloaded")  # the trace's device and host apart (FSDP's CPU offload)
        at_step, peaks = (off["device_before_optimizer"], off["device_peak_by_category"]) if off else \
            (m and m["before_optimizer"], m and m["peak_by_category"])
        for c in CATEGORIES:
            if m is None:
                cells.append(f"{c} {fmt_bytes(p[c])}")
                continue
            seen = (at_step or peaks)[c] if c != "activations" else peaks[c]
            row[f"measured {c}"] = seen
            name = "activations at their peak" if c == "activations" else c  # not the step's peak's share
            cells.append(f"{name} {fmt_bytes(p[c])} vs {fmt_bytes(seen)}" + (f" ({seen / p[c]:.3f})" if p[c] else ""))
        if m is not None and STAGING in m["peak_by_category"] and plan.strategy in DP_STRATEGIES:
            # --ckpt-async's host copy, traced where a checkpoint step fell in the window (CPU runs);
            # ckpt_staging_bytes knows the data-parallel family's state
            want, seen = ckpt_staging_bytes(plan.strategy, plan.cfg, plan.world, r, plan.shard), \
                m["peak_by_category"][STAGING]
            row |= {STAGING: want, f"measured {STAGING}": seen}
            cells.append(f"{STAGING} {fmt_bytes(want)} vs {fmt_bytes(seen)} ({seen / want:.3f})")
        if "host" in p:  # --cpu-offload: the sharded state, on the host
            have = off and off["host_before_optimizer"]
            row |= {"host": p["host"], **({"measured host": have} if have else {})}
            row |= {"measured device peak_by_category": peaks} if off else {}
            cells.append("on the host " + ", ".join(f"{c} {fmt_bytes(b)}" + (
                f" vs {fmt_bytes(have[c])}" + (f" ({have[c] / b:.3f})" if b else "") if have else "")
                for c, b in p["host"].items()))
        # the whole step's peak, and when the formulas put it (on CUDA the allocator's own peak
        # is the number to hold them to; the tracer counts the same tensors within 0.2%). Under
        # offload on a CPU, the allocator counts the host's share too: the trace less it, then.
        # CUDA path: tests/test_estimate.py::test_report_holds_an_offloaded_run_to_the_device_and_the_host
        seen = m and (off["device_peak_bytes"] if off and off["host_in_trace"]
                      else m.get("allocator_peak_bytes") or m["peak_bytes"])
        if seen:
            row["measured peak"] = seen
        cells.append(f"{'device peak' if off else 'peak'} {fmt_bytes(p['peak'])} ({p['peak_at']})"
                     + (f" vs {fmt_bytes(seen)} ({seen / p['peak']:.3f})" if seen else ""))
        out["per_rank"].append(row)
        who = f"rank {r}" if len(ranks) > 1 else "one rank"
        if r in (ranks[0], ranks[-1]) or len(ranks) <= 4:
            say(f"    {who:<8} " + ", ".join(cells))
    return out


# ---- context parallelism (common/parallelize/cp.py) --------------------------------------------
STRATEGIES += ("cp", "cp_fsdp")


def cp_bytes_per_step(cfg: ModelConfig, batch: int, seq_len: int, cp: int, bytes_per_el: int = 4,
                      recomputed_blocks: int = 0, device: str = "cpu") -> dict[str, int]:
    """What one rank of apply_cp's ring sends per step, logical bytes (``batch``: the
    sequences its cp group shares).

    A key/value block is this rank's keys and values: 2 x batch x seq/cp x kv width, in the
    compute dtype. Per block, forward passes it on cp-1 times; backward passes the blocks
    around again (cp-1 times) and, with each, the fp32 gradient of its keys and values,
    which needs cp hops to come home. Every send has its receive. Checkpointed blocks run
    their forward, ring included, again in backward. (Micro-batches change nothing: the
    same tokens cross in smaller blocks.)
    """
    if cp == 1:
        return {}
    width = cfg.n_kv_heads * cfg.head_dim
    # CUDA path: tests/test_estimate.py::test_where_the_1b_peaks_fall_and_what_is_device_specific
    if device == "cuda" and bytes_per_el == 4:
        width = cfg.dim  # the model copies k and v to every query head first (CUDA's fp32 kernel)
    kv = 2 * batch * (seq_len // cp) * width
    forward = (cp - 1) * kv * bytes_per_el
    sent = cfg.n_layers * (2 * forward + cp * kv * 4) + recomputed_blocks * forward
    return {"send": sent, "recv": sent}


def cp_predict(plan: Plan, rank: int = 0) -> dict:
    """Context parallelism: cp ranks share each sequence, dp = world / cp groups split the
    batch. The prediction of one device (``cp``) or of FSDP over every rank (``cp_fsdp``)
    at (batch / dp) x (seq / cp) tokens a rank, and what differs: the rotary tables are
    copied at this rank's positions (cos and sin: 2 x seq/cp x head_dim in the compute
    dtype) instead of viewed whole; the ring's bytes; DDP's all-reduce of the gradients over
    every rank (4 bytes a parameter; its buckets keep the gradients all step, as under
    ``ddp``), or, with FSDP, its reduce-scatter; the transients of one ring step (the
    key/value block sent and the one received, one block's fp32 scores and probabilities)."""
    cfg, cp = plan.cfg, plan.cp or plan.world
    dp, local, fsdp = plan.world // cp, plan.seq_len // cp, plan.strategy == "cp_fsdp"
    # the sub-plan whose ranks each see (batch / dp) x (seq / cp) tokens
    out = predict(replace(plan, strategy="fsdp_zero3", batch=plan.batch // dp * plan.world, seq_len=local, cp=None)
                  if fsdp else replace(plan, strategy="ddp", world=1, batch=plan.batch // dp, seq_len=local,
                                       cp=None), rank if fsdp else 0)
    b = DTYPE_BYTES[plan.dtype]
    seqs = plan.batch // dp // plan.accum
    # (in bf16 the whole tables' cast, which one device keeps, is a temporary here)
    out["activations"] += b * 2 * local * cfg.head_dim - (b * 2 * cfg.max_seq_len * cfg.head_dim if b == 2 else 0)
    # CUDA path: tests/test_estimate.py::test_where_the_1b_peaks_fall_and_what_is_device_specific
    width = cfg.dim if plan.device == "cuda" and b == 4 else cfg.n_kv_heads * cfg.head_dim
    ring = {"ring: key/value blocks in flight": 2 * 2 * seqs * local * width * b,
            "ring: one block's scores and probabilities (fp32)": 2 * 4 * seqs * cfg.n_heads * local * local}
    moments = {out["peak_at"]: out["peak"],
               "ring attention (forward)": out["parameters"] + out["optimizer state"] + out["activations"]
               + (0 if fsdp else out["gradients"])  # DDP's buckets hold the gradients all step
               + sum(ring.values()) + sum(v for k, v in out["transient"].items() if "FSDP" in k)}
    out["transient"] = {**out["transient"], **ring}
    comm = out["comm"] if fsdp else {}
    if plan.world > 1 and not fsdp:  # DDP's buckets: every gradient, once
        comm = {"all_reduce": 4 * sum(math.prod(s) for s in param_shapes(cfg).values())}
    out["peak_at"] = max(moments, key=moments.get)
    out["peak"] = moments[out["peak_at"]]
    checkpointed = checkpointed_blocks(cfg.n_layers, plan.ac, plan.ac_every)
    comm |= cp_bytes_per_step(cfg, plan.batch // dp, plan.seq_len, cp, b, checkpointed, plan.device)
    out["comm"] = comm
    return out


# ---- mixture of experts and expert parallelism ---------------------------------------------
def is_expert(name: str) -> bool:
    return ".feed_forward.experts." in name


def moe_activation_extra(plan: Plan, tokens: int, n_layers: int, shapes: dict) -> int:
    """What a MoE layer keeps beyond a dense MLP of the same width per token (an estimate).

    ``layer_activation_bytes`` counts the MLP at ffn_dim; a token goes through top_k
    experts, so k times that, and the layer keeps the router's fp32 probabilities (n_experts
    a token) and four copies of every (token, choice) row of ``dim`` values: gathered by
    expert, dispatched (or not), regrouped, weighed. Not held to the byte by the tests.
    In bf16 the layer casts its (local) experts itself (autocast does not cover grouped_mm,
    and FSDP's policy leaves the experts alone) and saves the copies for backward: 2 bytes
    an expert weight.
    """
    cfg, b = plan.cfg, DTYPE_BYTES[plan.dtype]
    k = cfg.top_k
    mlp = 4 * cfg.ffn_dim * b  # the MLP's four products of one expert
    per_token = (k - 1) * mlp + 4 * 2 * cfg.n_experts + 4 * k * cfg.dim * b
    w = (plan.ep or plan.world) if plan.strategy == "ep" else 1
    copies = 2 * sum(shard_numel(s, w, 0) for k, s in shapes.items() if is_expert(k)) if plan.dtype != "fp32" else 0
    return n_layers * tokens * per_token + copies


def ep_state(plan: Plan, shapes: dict, rank: int) -> dict[str, int]:
    """Model state under train_ep.py: the dense part sharded by FSDP over all the ranks,
    each rank's n_experts / ep experts whole (ep's rank index: rank % ep)."""
    ep = plan.ep or plan.world
    dense = _state("fsdp", {k: v for k, v in shapes.items() if not is_expert(k)}, plan.world, rank)
    experts = _state("fsdp", {k: v for k, v in shapes.items() if is_expert(k)}, ep, rank % ep)
    return {c: dense[c] + experts[c] for c in dense}


def ep_comm(plan: Plan, shapes: dict, tokens: int) -> dict:
    """Bytes per rank per step under train_ep.py: FSDP on the dense part only, the token
    all-to-alls (the mean over the ranks; a rank's own depends on its experts' popularity)
    and the small exchanges of counts."""
    from common.parallelize.ep import ep_bytes_per_step
    cfg = plan.cfg
    dense = {k: v for k, v in shapes.items() if not is_expert(k)}
    b = DTYPE_BYTES[plan.dtype]
    out = _dp_comm("fsdp_zero3", dense, plan.world, None, b, plan.accum)
    ep = plan.ep or plan.world
    if ep < plan.world:  # copies of each expert, one per group of ep ranks, sum their gradients
        out["all_reduce (expert grads)"] = 4 * sum(shard_numel(s, ep, 0) for k, s in shapes.items() if is_expert(k))
    if plan.world > 1:
        out["all_reduce (grad norm)"] = 4 * len(shapes)  # the experts' norms ride along
        out["all_to_all"] = ep_bytes_per_step(cfg, tokens, act_bytes=b, accum=plan.accum)
        out["all_to_all (expert counts)"] = 8 * cfg.n_experts * cfg.n_layers * plan.accum
        out["all_reduce (router counts)"] = 8 * cfg.n_experts * cfg.n_layers * plan.accum
    return out
