"""The memory and communication formulas of every strategy, one definition each.

common/measure/theory.py adds them up into a prediction for one layout (``predict``);
common/measure/splits.py says which parameters a rank holds, the shapes these count on.

Per rank, for our Llama model (common/model.py) trained with AdamW:

  model state     parameters 4 bytes/param, gradients 4, AdamW's two moments 8 (+ a 4-byte
                  step counter per parameter tensor), of the parameters this rank holds;
  activations     what autograd keeps from forward for backward (below), x tokens per rank;
  communication   logical bytes per optimizer step, by collective.

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
                adds are recomputed. Within a dozen bytes of the CPU tracer.
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
"""
from __future__ import annotations

import math

from common.measure.plan import ALIASES, Plan
from common.measure.splits import is_root, padded_shard_numel, param_shapes, shard_numel
from common.model import ModelConfig

DTYPE_BYTES = {"fp32": 4, "bf16": 2}


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
                      recomputed_blocks: int = 0, embedding: bool = True, output: bool = True) -> dict[str, int]:
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

    ``embedding``, ``output``: whether this rank holds them (a pipeline stage holds the
    embedding on the first stage only, the output layer on the last): their collective
    comes with them.
    """
    tokens = batch * seq_len * cfg.dim
    first = tokens * (embedding_bytes_per_el or bytes_per_el) if embedding else 0
    total = (4 * cfg.n_layers + output) * tokens * bytes_per_el + first
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


def w_pending_bytes(cfg: ModelConfig, tokens: int, dtype: str = "fp32", tp: int = 1,
                    sequence_parallel: bool = False, head: bool = False) -> int:
    """What a split backward keeps of one block (and, ``head``, of the final norm and the output
    layer) from its input half ("I") to its weight half ("W"), for ``tokens`` tokens: PyTorch's
    pipelining hands W the gradients that reached the outputs of the ops whose weights it
    differentiates, so each matmul's output gradient (q, k, v, wo, w1, w3, w2: in the compute
    dtype; wo's and w2's full width under TP, whose row-parallel products are partial sums of the
    whole width) and each norm's (the scaled output, fp32) wait there. Listed from a dry run of ZBV
    (tests/test_estimate.py's missed layouts); the first stage runs its whole backward in W."""
    d, f, kv = cfg.dim, cfg.ffn_dim, cfg.n_kv_heads * cfg.head_dim
    b = 4 if dtype == "fp32" else 2
    split = tp if sequence_parallel else 1
    if head:  # the output layer's (the logits', vocabulary split under TP) and the final norm's
        return tokens * (b * cfg.vocab_size // tp + 4 * d // split)
    return tokens * (b * ((d + 2 * kv + 2 * f) // tp + 2 * d) + 4 * 2 * d // split)


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
    (tokens, vocab) gradients (of the log-probabilities and of the logits); under loss
    parallelism (``tp`` > 1: DTensor's handler of the nll loss's backward, which does the
    log-softmax's backward too, on each rank's vocabulary slice) three: ``zeros_like`` of the
    log-probabilities, their ``exp`` and the sum of the two, before it is scaled (ops the
    handler runs below the memory trace: the CPU allocator's peak counts them); the chunked
    one (common/loss.py) one chunk's logits and their softmax (fp32: 8 bytes an entry), the
    output layer's whole gradient (``weight_bytes`` a value) and the gradient of its input."""
    v = cfg.vocab_size // tp
    if loss_chunks <= 1:
        return (12 if tp > 1 else 8) * v * tokens
    chunk = -(-tokens // loss_chunks)
    return 8 * v * chunk + weight_bytes * v * cfg.dim + DTYPE_BYTES[dtype] * tokens * cfg.dim


def amp_weight_copies(shapes: dict) -> int:
    """autocast's bf16 copy of each weight matrix, saved by the matmuls that use it."""
    return sum(2 * math.prod(s) for k, s in shapes.items() if k.endswith("weight") and "norm" not in k
               and not k.startswith("tok_embeddings"))


def checkpointed_blocks(n_layers: int, ac: str, every: int = 1) -> int:
    """How many of ``n_layers`` blocks apply_ac checkpoints (blocks 0, k, 2k, ...)."""
    return 0 if ac == "none" else -(-n_layers // every)



# ---- context parallelism (common/parallelize/cp.py) --------------------------------------------

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


# ---- mixture of experts and expert parallelism ---------------------------------------------
def is_expert(name: str) -> bool:
    return ".feed_forward.experts." in name


def moe_activation_extra(plan: Plan, tokens: int, n_layers: int, shapes: dict) -> int:
    """What a MoE layer keeps beyond a dense MLP of the same width per token (an estimate).

    ``layer_activation_bytes`` counts the MLP at ffn_dim; a token goes through top_k
    experts, so k times that, and the layer keeps two fp32 tensors of the router's (its
    logits' softmax and what top-k renormalises: n_experts a token each) and four copies of every (token, choice) row of ``dim`` values: gathered by
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
