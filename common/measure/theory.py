"""The prediction: what each rank of one training configuration (``Plan``, common/measure/plan.py)
holds and sends (``predict``), and that prediction beside the measurement at the end of a run
(``report``).

The bytes it adds up are common/measure/formulas.py's (model state, activations,
communication, one definition each); the parameters each rank holds, common/measure/splits.py's.

The peak is the largest of five moments (``_peak``, more where they apply): the end of
forward (no gradients yet when the last step freed them, autocast's cache still full), the
loss's backward, the start of backward (one block rebuilt), the end of backward (every
gradient), and the optimizer step, where CUDA's default foreach AdamW holds sqrt(v) for
every parameter at once (4 bytes a parameter); under DDP a sixth, the second step's start,
where DDP rebuilds its gradient buckets; accumulating without FSDP, the moment a later
micro-batch's output-layer gradient lands; under FSDP its forward's first all-gathers, and
with ``--split-root-unit`` the loss's forward and the head unit's reduce-scatter. At 1b, 4 x 2048 on one GPU (tests/test_estimate.py holds the numbers) the formula is within
1.5% of what an H200 measured: the allocator's peak for fp32 and bf16 autocast, the memory
tracer's for selective and full AC (the optimizer step, 20N exactly), whose allocator peak
also held an earlier run (tools/estimate.py's gpu_1b_peaks). ``python -m tools.saved_census --device cuda`` lists
what one block keeps on a GPU, node by node (on CPU it equals this count to the byte).

The measured band (tests/test_estimate.py, CPU): the formula's activations equal the
tracer's within 1% for fp32, bf16, selective and full AC on one device, 2% under TP; the
peak within -5%/+10% (backward's own temporaries are left out). The bf16 formula is
autocast's; FSDP's MixedPrecisionPolicy (bf16 weights gathered, no autocast) saves less
(no weight copies, one input cast): there it is an upper bound.

FSDP's CPU offload (``Plan.cpu_offload``, train_fsdp.py --cpu-offload): the parameter shards,
their gradients and AdamW's state live on the host (``predict``'s ``"host"``: the 16N/W bytes
of the model state, the gradients unpadded on CUDA, where each shard is copied out of the reduce-scatter's
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

import math
from dataclasses import replace

from common.measure.formulas import (DTYPE_BYTES, _dp_comm, _state, amp_weight_copies,
                                     checkpointed_blocks, ckpt_staging_bytes, cp_bytes_per_step, ep_comm, ep_state,
                                     head_activation_bytes, is_expert, layer_activation_bytes, loss_backward_bytes,
                                     moe_activation_extra, pp_bytes_per_step, tp_bytes_per_step, w_pending_bytes)
from common.measure.plan import DP_STRATEGIES, Plan
from common.measure.splits import (_loops, _rank_stages, is_root, padded_shard_numel, param_shapes, rank_shapes,
                                   shard_numel, stage_layers)
from common.parallelize.schedules import V_SCHEDULES, schedule_actions

CATEGORIES = ("parameters", "gradients", "optimizer state", "activations")


def v_live_peak(plan: Plan, rank_stage: int, bytes_per_microbatch: dict[int, float],
                pending_per_microbatch: dict[int, float] | None = None) -> float:
    """The most a V-schedule rank holds at once of ``bytes_per_microbatch[stage]`` per live
    micro-batch of each of its two stages. A micro-batch's activations on a stage live from
    its forward ("F") to the end of its backward: the full backward ("B") or, where the
    schedule splits it, the weight half ("W"), which still needs the layers' saved inputs
    after the input half ("I") has passed the gradient on. ``pending_per_microbatch``: what
    waits from a micro-batch's I to its W besides (``formulas.w_pending_bytes``), counted with
    them. Counted along the order PyTorch's schedule runs
    (common/parallelize/schedules.py:schedule_actions)."""
    m = plan.microbatches or plan.pp
    try:
        actions = schedule_actions(plan.schedule, plan.pp, m)[rank_stage]
    except (AttributeError, TypeError, ValueError):  # a PyTorch whose schedule builds its lists otherwise:
        # ZBV's counts (the first-leg stage holds up to 2p - r micro-batches, the return stage r)
        first, back = sorted(bytes_per_microbatch)
        return min(m, 2 * plan.pp - rank_stage) * bytes_per_microbatch[first] + \
            min(m, rank_stage) * bytes_per_microbatch[back]
    live, pending = dict.fromkeys(bytes_per_microbatch, 0), dict.fromkeys(bytes_per_microbatch, 0)
    waits = pending_per_microbatch or {}
    peak = 0.0
    for kind, s, _ in actions:
        live[s] += {"F": 1, "B": -1, "W": -1}.get(kind, 0)
        pending[s] += {"I": 1, "W": -1}.get(kind, 0)
        peak = max(peak, sum(n * bytes_per_microbatch[k] + pending[k] * waits.get(k, 0) for k, n in live.items()))
    return peak


def _peak(plan: Plan, kind: str, fsdp: bool, out: dict, transient: dict) -> tuple[int, str, int]:
    """The step's peak: the largest of five moments (and more where they apply).

    - end of forward: parameters, AdamW state, every activation and autocast's cache of
      bf16 weight copies (alive until the loss is computed, see ``predict``). The gradients
      are not there yet when the previous step freed them (``zero_grad(set_to_none=True)``
      with one micro-batch and no DDP); DDP keeps its gradient buckets, accumulation and
      pipelines keep the gradients of the earlier micro-batches.
    - the loss's backward: the same less the cache, with FSDP's root (or head) unit and one
      block gathered, plus the loss's gradients (``loss_backward_bytes``): the peak of a
      large vocabulary's plain loss;
    - start of backward: the same less the cache, plus one block rebuilt by checkpointing (with
      ``--ac-every`` k, less the trailing unchecked blocks' activations, freed before it);
    - end of backward: every gradient, and the first block rebuilt (what matters under full
      AC, where the activations are small and the gradients are not);
    - accumulating (micro-batches of --grad-accum or of a pipeline) without FSDP, a later
      micro-batch's output-layer gradient landing beside the summed ones (``NEW_OUTPUT_GRAD``);
    - under DDP (and ZeRO-1), the second step's start (``ddp_rebuild``);
    - under FSDP, the forward's first all-gathers (``FORWARD_GATHER``: a unit's all-gather
      output outlives its copy-out until the next unit's), in a later micro-batch beside the
      earlier ones' summed gradients; with ``--split-root-unit`` the loss's forward, where the
      head's all-gather output is still held, and the head's reduce-scatter, the first of
      backward (``SPLIT_LOSS_FORWARD``, ``SPLIT_HEAD_REDUCE``);
    - with the CPU's kernels, the final norm's backward (``NORM_BACKWARD``): the head's
      activations freed but the norm's input, the output layer's gradient, and the composite
      fp32 norm's five (tokens, d) temporaries: the peak of TP at a small vocabulary;
    - the optimizer step: parameters, gradients, AdamW state and its temporaries. On CUDA
      AdamW defaults to the foreach kernels, which build sqrt(v) for every parameter at once
      (4 bytes a parameter: half the state); on CPU it updates one tensor at a time, holding
      two temporaries the size of the tensor (``exp_avg_sq.sqrt() / bias_correction2_sqrt``:
      8 bytes an element of the largest, a large vocabulary's output layer), and
      ``--fused-adamw`` runs one kernel that holds none (``plan.optimizer``).
    FSDP's gathered weights count at every moment but the optimizer step (one block fewer at
    the loss's backward; under ZeRO-2 every unit, but at the end of backward only what ZeRO-3
    keeps); its unsharded gradients (one block's, while FSDP reduce-scatters them) from the
    start of backward on. A pipeline stage's receive buffers (``PP_RECV``) count at every moment.
    Returns (peak, which moment, the optimizer's temporaries).
    """
    state_bytes = out["optimizer state"]
    grads_live = kind in ("ddp", "zero1") or plan.accum > 1 or plan.pp > 1
    # FSDP accumulating: the earlier micro-batches' gradients are unsharded (ACCUM_GRADS), and
    # the sharded ones exist only from the last reduce-scatter on
    accumulated = transient.get(ACCUM_GRADS, 0) or (out["gradients"] if grads_live else 0)
    base = out["parameters"] + state_bytes + out["activations"] + accumulated
    base += sum(v for k, v in transient.items() if "FSDP" in k)
    waiting = transient.get(W_PENDING, 0)  # from the first input half on: backward's moments only
    cache = sum(v for k, v in transient.items() if k.startswith("autocast"))
    rebuilt = sum(v for k, v in transient.items() if "recomputed" in k)
    loss = sum(v for k, v in transient.items() if k.startswith(LOSS_BACKWARD))
    at_loss = base - sum(v for k, v in transient.items() if "FSDP" in k) + out.get("FSDP at the loss", 0)
    # foreach: half the state, one fp32 value a parameter (the few bytes of step counters aside);
    # for-loop: the largest tensor's sqrt(v) and its quotient by the bias correction, alive together
    temporaries = {"foreach": state_bytes // 2,
                   "for-loop": 2 * 4 * out.get("largest tensor", 0)}.get(plan.optimizer, 0)
    full = out["parameters"] + out["gradients"] + state_bytes
    unsharded = transient.get(UNSHARDED_GRADS, 0)  # a block's gradients: backward's, not forward's
    # (the wait is none at the loss's backward: the last stage's I is followed at once by its W)
    moments = {"end of forward": base - unsharded + cache, "loss backward": at_loss + loss,
               "start of backward": base + max(0, rebuilt - out.get(FREED_BEFORE_REBUILD, 0)) + waiting,
               "end of backward": max(full + rebuilt + out.get("FSDP at the end of backward", 0),
                                      out["parameters"] + state_bytes + sum(out.get(ROOT_REDUCE, {}).values())),
               "optimizer step": full + temporaries}
    if NORM_BACKWARD in transient:
        moments[NORM_BACKWARD] = at_loss - out[FREED_AT_NORM] + transient[NORM_BACKWARD]
    if NEW_OUTPUT_GRAD in transient:
        moments["output layer's backward (accumulating)"] = (base - out[RELEASED_AT_OUTPUT]
                                                             + transient[NEW_OUTPUT_GRAD])
    for k in (SPLIT_LOSS_FORWARD, SPLIT_HEAD_REDUCE):  # --split-root-unit's head unit (see predict)
        if k in out:
            moments[k] = (out["parameters"] + state_bytes + out[k] + transient.get(ACCUM_GRADS, 0)
                          + out["activations"] - (out[RELEASED_AT_OUTPUT] if k == SPLIT_HEAD_REDUCE else 0))
    if FORWARD_GATHER in out:  # a later micro-batch's forward (accumulating): the earlier ones' gradients too
        moments[FORWARD_GATHER] = (out["parameters"] + state_bytes + out[FORWARD_GATHER]
                                   + (transient.get(ACCUM_GRADS, 0) if plan.accum > 1 and plan.pp == 1 else 0))
    if kind in ("ddp", "zero1") and plan.dp > 1:
        moments[DDP_REBUILD] = ddp_rebuild(out, 16 * (plan.batch // plan.dp // plan.accum) * plan.seq_len)
    moments = {k: v + transient.get(PP_RECV, 0) for k, v in moments.items()}  # alive at every moment
    at = max(moments, key=moments.get)
    return moments[at], at, temporaries


DDP_REBUILD = "DDP's bucket rebuild (second step)"


def ddp_rebuild(out: dict, batch_bytes: int) -> int:
    """The start of DDP's second step: it rebuilds its gradient buckets once, in the order the
    first backward produced the gradients, allocating the new buckets while the old ones
    (which ``gradient_as_bucket_view`` gradients are views of) are still alive: every
    gradient twice, beside the parameters, AdamW's state and the batch, before any activation
    (measured on dry runs of train_ddp.py, tests/test_estimate.py). A small model at a short
    sequence, or a large one, peaks here."""
    return out["parameters"] + out["optimizer state"] + 2 * out["gradients"] + batch_bytes


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
FORWARD_GATHER = "FSDP's first all-gathers of the forward"
SPLIT_LOSS_FORWARD = "the loss's forward (the head unit's all-gather output still held)"
SPLIT_HEAD_REDUCE = "the head unit's reduce-scatter (first in backward)"
ACCUM_GRADS = "earlier micro-batches' gradients, unsharded (until the last reduce-scatter)"
LOSS_BACKWARD = "the loss's backward"
UNSHARDED_GRADS = "unsharded gradients (FSDP)"
PP_RECV = "pipeline receive buffers (fp32 activations and their gradients)"
NEW_OUTPUT_GRAD = "a later micro-batch's output-layer gradient, before it is added in"
RELEASED_AT_OUTPUT = "freed by the output layer's backward"
NORM_BACKWARD = "the final norm's backward"  # (on the CPU: its fp32 temporaries, the head's gradients)
FREED_AT_NORM = "freed before the final norm's backward"
W_PENDING = "gradients waiting for the weight half (split backward)"
FREED_BEFORE_REBUILD = "freed by backward before the first block is rebuilt"


def _root_reduce(plan: Plan, shapes: dict, shard: int, grads: int, tokens: int, in_flight_act: int = 0) -> dict[str, int]:
    """The last moment of an FSDP backward, less the parameter shards and AdamW state: the
    root unit (embedding, final norm, output layer) is the last to be reduce-scattered.
    Its gathered weights are freed by then (FSDP reshards a unit before reducing it), and
    FSDP's ``foreach_reduce`` copies its full-size gradients (in the compute dtype) into the
    reduce-scatter buffer (fp32, the reduce dtype), beside every other unit's gradient shard
    and the logits the script still holds (fp32: the root's output dtype). Then two moments,
    the larger of which this returns: the copy-in, every full gradient and the buffer alive
    together; and the reduce-scatter, after FSDP has dropped its list of the full gradients,
    where the buffer, its fp32 output (this rank's shard of the root's gradients) and the
    unit's last full gradient are alive: the loop over the gradients (``foreach_reduce``,
    for FSDP groups of two or more ranks) leaves its variable bound to the last one until the
    function returns. Dry runs of 2-D (an FSDP group of 2) at a 32K vocabulary peak there;
    small with a byte vocabulary; with a 128K one the root is larger than any block
    (measured at 1b, rank 0 of 8: 0.98 GiB of bf16 gradients and a 1.96 GiB buffer at the
    copy-in). Under TP a third moment comes first: the embedding's backward, which makes the
    whole vocabulary's gradient beside the gathered root (fp32 2-D at a 32K vocabulary peaks
    there). Accumulating (``--grad-accum``, a pipeline's micro-batches) the gradients FSDP
    reduces are its fp32 sums, the embedding's over the whole vocabulary under TP; a
    pipeline's schedule reduces every unit after its last backward, the root first, so the
    other units' sums are still whole then (and gathered, under 3-D's ZeRO-2), and a middle
    micro-batch's embedding backward has them whole too, beside the activations of the
    micro-batches in flight (``in_flight_act``)."""
    root = {k: s for k, s in shapes.items() if is_root(k) and not (plan.split_root and not k.startswith(
        "tok_embeddings."))}  # --split-root-unit: the embedding's unit is the last to reduce
    if not root:
        return {}
    full = sum(padded_shard_numel(s, shard) * shard for s in root.values())
    own = 4 * sum(padded_shard_numel(s, shard) for s in root.values())
    last = padded_shard_numel(list(root.values())[-1], shard) * shard if shard > 1 else 0
    logits = (4 * tokens * (plan.cfg.vocab_size // (plan.tp if plan.loss_parallel else 1))
              if "output.weight" in root and not plan.head_loss else 0)
    # accumulating (--grad-accum, a pipeline's micro-batches), the full gradients FSDP reduces
    # are the fp32 ones it summed the micro-batches' into
    accumulating = plan.accum > 1 or plan.pp > 1
    g, kept = (4, "fp32, accumulated") if accumulating else (DTYPE_BYTES[plan.dtype], plan.dtype)
    b = DTYPE_BYTES[plan.dtype]
    # the other units' gradients: sharded by then, where the root reduces last; whole (their fp32
    # sums) under a pipeline, whose schedule reduces every unit after its last backward, the
    # root first, while ZeRO-2 (3-D's stages) keeps every unit gathered (3-D's dry runs)
    others = {"other units' summed gradients (fp32, whole)": 4 * sum(
        math.prod(s) for k, s in shapes.items() if k not in root and not (plan.strategy == "ep" and is_expert(k)))}
    if plan.dp_kind.endswith("zero2"):
        others[f"other units' gathered parameters ({plan.dtype})"] = b * sum(
            math.prod(s) for k, s in shapes.items() if k not in root)
    shards = others if plan.pp > 1 else {"other units' gradient shards": grads - own}
    copy_in = {**shards,
               f"root's full gradients ({kept})": g * full,
               "root's fp32 reduce-scatter copy": 4 * full,
               "logits still held (fp32)": logits}
    reduce = {**shards,
              "root's fp32 reduce-scatter copy": 4 * full,
              "root's reduce-scatter output (fp32)": own,
              f"root's last full gradient ({kept}, still referenced)": g * last,
              "logits still held (fp32)": logits}
    moments = [copy_in, reduce]
    if plan.tp > 1 and "tok_embeddings.weight" in root:
        # under TP the embedding's backward (DTensor's, the last of the step) makes the gradient
        # of the whole vocabulary and then copies out this rank's rows, while the root is still
        # gathered and the output layer's full gradient waits for the root's reduce-scatter.
        # Accumulating over three micro-batches or more, a middle one's is larger: the other
        # units' summed gradients are still whole (fp32) then, not yet reduce-scattered, and
        # ZeRO-2 (3-D's stages) keeps every unit gathered
        emb = padded_shard_numel(root["tok_embeddings.weight"], shard) * shard
        out_full = (padded_shard_numel(root["output.weight"], shard) * shard if "output.weight" in root else 0)
        middle = accumulating and (plan.accum if plan.pp == 1 else plan.microbatches or plan.pp) >= 3
        # (under a pipeline, beside the activations of the micro-batches the schedule has in flight)
        moments.append((others if middle else shards) | {
                        "other micro-batches' activations (in flight)": in_flight_act,
                        f"root's gathered parameters ({plan.dtype})": b * full,
                        f"the output layer's full gradient ({plan.dtype})": b * out_full,
                        f"the embedding's whole-vocabulary gradient ({plan.dtype}, TP)": b * emb * plan.tp,
                        "logits still held (fp32)": logits}
                       | ({"the earlier micro-batches' root gradients (fp32; the embedding's whole vocabulary)":
                           4 * (full + emb * (plan.tp - 1))} if accumulating else
                          # (accumulating, it is added into those instead, and the rows are taken out
                          # of the sum at the reduce-scatter)
                          {f"its copy of this rank's rows ({plan.dtype})": b * emb}))
    return max(moments, key=lambda m: sum(m.values()))


def _v_activations(plan: Plan, stage: int, tokens: int) -> tuple[int, int, int]:
    """A V-schedule rank's activations at their peak, the most micro-batch-stages alive then
    (each stage's forward casts its own bf16 RoPE tables), and what the split backward keeps
    waiting for the weight halves beside them at the two's joint peak (``W_PENDING``): each
    stage's blocks (checkpointed from its own first block) and, on the last stage, the head,
    weighted by its live micro-batches."""
    cfg, n_stages = plan.cfg, 2 * plan.pp
    per_mb, waits = {}, {}
    for s in _rank_stages(plan, stage):
        n = len(stage_layers(cfg.n_layers, n_stages)[s])
        k = checkpointed_blocks(n, plan.ac, plan.ac_every)
        per_mb[s] = sum(c * layer_activation_bytes(cfg, tokens, plan.dtype, ac, plan.tp, plan.sequence_parallel,
                                                   plan.device) for c, ac in ((k, plan.ac), (n - k, "none")) if c)
        if s == n_stages - 1:
            per_mb[s] += head_activation_bytes(cfg, tokens, plan.dtype, plan.tp, plan.loss_parallel,
                                               plan.sequence_parallel)
        # the first stage runs its whole backward in W: its I keeps nothing
        waits[s] = 0 if s == 0 else (
            n * w_pending_bytes(cfg, tokens, plan.dtype, plan.tp, plan.sequence_parallel)
            + (w_pending_bytes(cfg, tokens, plan.dtype, plan.tp, plan.sequence_parallel, head=True)
               if s == n_stages - 1 else 0))
    act = int(v_live_peak(plan, stage, per_mb))
    return act, int(v_live_peak(plan, stage, dict.fromkeys(per_mb, 1))), int(v_live_peak(plan, stage, per_mb, waits)) - act


def _largest_local(plan: Plan, shapes: dict, shard: int) -> int:
    """The most elements one tensor the optimizer updates on this rank has: a parameter's
    padded shard under FSDP (EP: the experts split ep ways, the dense part over the world),
    the whole parameter otherwise (ZeRO-1's partition owns whole parameters: the largest is
    an upper bound for a rank that owns smaller ones)."""
    if plan.strategy == "ep":
        return max(padded_shard_numel(s, (plan.ep or plan.world) if is_expert(k) else plan.world)
                   for k, s in shapes.items())
    return max(padded_shard_numel(s, shard) for s in shapes.values())


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
    if plan.tp > 1 and "tok_embeddings.weight" in shapes and not (fsdp and plan.dp > 1):
        # DTensor's embedding backward returns the vocabulary-split weight's gradient
        # replicated: every TP rank holds the whole (V, d) gradient, not its 1/tp rows
        # (tests/test_claims.py); FSDP under 2-D reduce-scatters it into its shard (at dp 1 there
        # is no FSDP: apply_fsdp wraps nothing)
        out["gradients"] += 4 * (cfg.vocab_size * cfg.dim - math.prod(shapes["tok_embeddings.weight"]))

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
    # ... on top of the policy, whose bf16 embedding makes the residual stream bf16 there too: a
    # checkpointed block's input is 2 bytes a value (the count without AC stays autocast's)
    act = sum(k * layer_activation_bytes(cfg, tokens, plan.dtype, ac, plan.tp, plan.sequence_parallel, plan.device,
                                         fsdp and plan.dp > 1)
              for k, ac in ((checkpointed, plan.ac), (n_layers - checkpointed, "none")) if k)
    head = head_activation_bytes(cfg, tokens, plan.dtype, plan.tp, plan.loss_parallel, plan.sequence_parallel,
                                 # FSDP's root hands the loss fp32 logits (output_dtype), under 2-D too
                                 fp32_logits=plan.strategy.startswith(("fsdp", "hsdp")) or (fsdp and plan.dp > 1),
                                 head_loss=plan.head_loss,
                                 loss_chunks=plan.loss_chunks) if "output.weight" in shapes else 0
    act += head
    act *= in_flight
    w_pending = 0
    if plan.schedule in V_SCHEDULES and plan.pp > 1:  # two stages whose micro-batches come and go apart
        act, in_flight, w_pending = _v_activations(plan, stage, tokens)
    act += 16 * (plan.batch // plan.dp // plan.accum) * plan.seq_len  # the batch's x and y, int64
    transient = {W_PENDING: w_pending} if w_pending else {}
    if plan.dtype == "bf16":
        if not (fsdp and (plan.dp > 1 or plan.tp == 1)):  # FSDP's bf16 gathers bf16 weights (a transient
            # below) instead of autocast's copies (but at dp 1 apply_fsdp wraps a TP model in nothing, and
            # autocast casts, as under TP)
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
    # (under CPU offload the optimizer step runs on the host: no device temporaries)
    out["largest tensor"] = 0 if plan.cpu_offload else _largest_local(plan, shapes, shard if fsdp else 1)
    if cfg.n_experts:
        act += moe_activation_extra(plan, tokens, n_layers, shapes)
    out["activations"] = act

    # what comes and goes during the step, on top of the above
    first = str(min(int(x.split(".")[1]) for x in shapes if x.startswith("layers."))) if n_layers else None
    block = {k: v for k, v in shapes.items() if k.startswith("layers.") and k.split(".")[1] == first}
    block_n = sum(math.prod(s) for k, s in block.items() if not (plan.strategy == "ep" and is_expert(k)))
    if fsdp and plan.dp > 1:
        pbytes = DTYPE_BYTES[plan.dtype]
        if plan.split_root:  # the head's unit stays gathered from its forward to its backward; a block, and
            # the next one prefetched (the embedding's unit is gathered only around its own forward and backward)
            zero3 = sum(math.prod(s) for k, s in shapes.items() if is_root(k) and not k.startswith(
                "tok_embeddings.")) + 2 * block_n
        else:  # the root stays gathered; a block, and the next one prefetched
            zero3 = sum(math.prod(s) for k, s in shapes.items() if is_root(k)) + 2 * block_n
        # ZeRO-2 keeps every unit gathered from its forward to its backward
        gathered = sum(math.prod(s) for s in shapes.values()) if kind.endswith("zero2") else zero3
        transient["gathered parameters (FSDP" + (", head in its own unit)" if plan.split_root else ")")] = \
            pbytes * gathered
        # a block's full gradients in the compute dtype and their fp32 copy in the
        # reduce-scatter buffer, alive together while FSDP reduces it (see _root_reduce)
        transient[UNSHARDED_GRADS] = (pbytes + 4) * block_n
        if plan.accum > 1 or plan.pp > 1:
            # --grad-accum (set_requires_gradient_sync(False) but for the last micro-batch) and a
            # pipeline's micro-batches (the schedule does the same): FSDP keeps every unit's
            # whole fp32 gradient from the first micro-batch's backward to the last one's
            # reduce-scatter, 4 bytes a parameter of the rank's unsharded share, not 4/W; a
            # block's new gradient adds into it, so only the reduce-scatter's fp32 copy is new
            transient[ACCUM_GRADS] = 4 * sum(math.prod(s) for k, s in shapes.items()
                                             if not (plan.strategy == "ep" and is_expert(k)))
            if plan.tp > 1 and "tok_embeddings.weight" in shapes:
                # under 2-D the embedding's gradient is DTensor's whole-vocabulary one (see above), and
                # FSDP accumulates it so: only the last reduce-scatter takes this rank's rows out of it
                transient[ACCUM_GRADS] += 4 * (cfg.vocab_size * cfg.dim - math.prod(shapes["tok_embeddings.weight"]))
            if plan.strategy == "ep":  # the rank's own experts are no FSDP unit: their gradients, as they are
                transient[ACCUM_GRADS] += 4 * sum(padded_shard_numel(s, plan.ep or plan.world)
                                                  for k, s in shapes.items() if is_expert(k))
            transient[UNSHARDED_GRADS] = 4 * block_n
        # by the end of backward FSDP has resharded each unit after its own backward, ZeRO-2's
        # too: what is still gathered is what ZeRO-3 keeps
        out["FSDP at the end of backward"] = pbytes * zero3 + transient[UNSHARDED_GRADS]
        # when the loss's backward runs, no block's gradient exists yet and one block is gathered
        # (backward's prefetch of the last), not two
        out["FSDP at the loss"] = pbytes * (gathered - (block_n if not kind.endswith("zero2") else 0))
        # forward's all-gathers: FSDP frees a unit's all-gather output only after the next unit's
        # copy-out (so that the copy-out overlaps the next all-gather: wait_for_unshard drops
        # comm_ctx.all_gather_state before the copy-out, but its local still holds the result
        # until it returns), so at the first block's
        # copy-out the root is there twice (its output and its parameters) and so is the block
        # (with the head in a unit of its own, the embedding's unit is the first). With --grad-accum
        # a later micro-batch does it beside the earlier ones' unsharded gradients (measured on
        # dry runs at a 32K vocabulary, short sequences: tests/test_estimate.py)
        first_unit = sum(math.prod(s) for k, s in shapes.items() if is_root(k) and (
            k.startswith("tok_embeddings.") or not plan.split_root))
        out[FORWARD_GATHER] = pbytes * 2 * (first_unit + block_n)
        if plan.split_root and not kind.endswith("zero2"):
            # ... but the embedding's unit reshards after its own forward, before block 0's gather:
            # its output then stays beside the block's two, its parameters do not
            out[FORWARD_GATHER] = pbytes * max(2 * first_unit, first_unit + 2 * block_n)
        if root := _root_reduce(plan, shapes, shard, out["gradients"], tokens,
                                out["activations"] * (in_flight - 1) // in_flight):
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
        if plan.dtype == "bf16" and not (fsdp and (plan.dp > 1 or plan.tp == 1)):
            # ... under autocast its matmuls cast the block's weights to bf16 again (the first
            # forward's copies died with its cache), alive until the block's backward is done
            rebuilt += amp_weight_copies(block)
        transient[f"one block recomputed ({plan.ac} AC)"] = rebuilt
        # --ac-every k: the blocks after the last checkpointed one keep everything, and backward
        # frees theirs (one micro-batch's) before it rebuilds the first checkpointed block
        trailing = n_layers - 1 - (n_layers - 1) // plan.ac_every * plan.ac_every
        out[FREED_BEFORE_REBUILD] = trailing * layer_activation_bytes(
            cfg, tokens, plan.dtype, "none", plan.tp, plan.sequence_parallel, plan.device)
    if "output.weight" in shapes:  # the loss's backward, on the last stage
        what = "plain" if plan.loss_chunks <= 1 else f"in {plan.loss_chunks} chunks"
        transient[f"{LOSS_BACKWARD} ({what})"] = loss_backward_bytes(
            cfg, tokens, plan.dtype, plan.loss_chunks, plan.tp if plan.loss_parallel else 1,
            DTYPE_BYTES[plan.dtype] if mp_policy else 4)
    if plan.pp > 1:  # each stage's receive buffers, one a micro-batch, kept from step to step
        n_stages = plan.pp * loops
        transient[PP_RECV] = sum(((s > 0) + (s < n_stages - 1)) * m * 4 * tokens * cfg.dim
                                 for s in _rank_stages(plan, stage))
    if fsdp and plan.dp > 1 and plan.split_root and "output.weight" in shapes and plan.pp == 1:
        # --split-root-unit: the head (final norm, output layer) is the forward's last unit, and
        # FSDP frees its all-gather output only when the whole forward ends (the root's
        # post-forward), after the loss the model computes: the head twice, beside the bf16
        # logits and their fp32 copy. In backward the head's unit is the first to reduce-scatter,
        # beside every activation but the head's: its full gradients (the fp32 sums, accumulating),
        # the fp32 buffer and its output, and the last block, gathered again for its backward
        head_n = sum(math.prod(s) for k, s in shapes.items() if is_root(k) and not k.startswith("tok_embeddings."))
        v = cfg.vocab_size // (plan.tp if plan.loss_parallel else 1)
        # (ZeRO-2 keeps every other unit gathered through both moments; ZeRO-3 only the block
        # backward gathers first)
        others = pbytes * (sum(math.prod(s) for s in shapes.values()) - head_n) if kind.endswith("zero2") else 0
        out[SPLIT_LOSS_FORWARD] = pbytes * 2 * head_n + others + (
            (4 + (pbytes if pbytes < 4 else 0)) * tokens * v if plan.loss_chunks <= 1 else 0)
        out[SPLIT_HEAD_REDUCE] = ((0 if plan.accum > 1 else pbytes * head_n) + 4 * head_n
                                  + 4 * sum(padded_shard_numel(s, shard) for k, s in shapes.items()
                                            if is_root(k) and not k.startswith("tok_embeddings."))
                                  + (others or pbytes * block_n))
        out[RELEASED_AT_OUTPUT] = head
    if (plan.accum > 1 or plan.pp > 1) and not fsdp and "output.weight" in shapes:
        # accumulating, a later micro-batch's output-layer gradient lands beside the gradients
        # already summed: under autocast the matmul's bf16 gradient and its fp32 cast together
        # (AccumulateGrad then adds it in), once this micro-batch's head activations and its
        # bf16 copy of the weight are freed (backward has left the loss and the matmul)
        n_out = math.prod(shapes["output.weight"])
        copy = 2 * n_out if plan.dtype == "bf16" and not mp_policy else 0
        transient[NEW_OUTPUT_GRAD] = copy + 4 * n_out
        out[RELEASED_AT_OUTPUT] = head + copy
    if (plan.device == "cpu" and "output.weight" in shapes and plan.pp == 1 and plan.loss_chunks <= 1
            and not plan.sequence_parallel and not (fsdp and plan.dp > 1)):
        # The final norm's backward, just after the loss's and the output layer's: the head's
        # activations are freed but the norm's saved input and 1/rms, and the CPU's composite
        # fp32 norm holds five (tokens, d) temporaries at once (the fused CUDA kernel: not yet
        # measured). Under TP at a small vocabulary, split over the ranks, this outgrows the
        # loss's backward (train_tp.py at the byte vocabulary: 1.07 of the formula without it).
        out[FREED_AT_NORM] = head - tokens * (4 * cfg.dim + 4)
        live = kind in ("ddp", "zero1") or plan.accum > 1  # every gradient already counted (_peak's base)
        grads = 0 if live else 4 * (math.prod(shapes["output.weight"]) + cfg.dim)  # the output layer's, the norm's
        transient[NORM_BACKWARD] = grads + 5 * 4 * cfg.dim * tokens
    out["transient"] = transient
    out["peak"], out["peak_at"], out["optimizer temporaries"] = _peak(plan, kind, fsdp, out, transient)

    comm = {}
    if plan.dp > 1:
        dp_strategy = {"single": "ddp", "hsdp": "hsdp_zero3"}.get(kind, kind)
        comm |= _dp_comm(dp_strategy, shapes, plan.dp, plan.shard if kind.startswith("hsdp") else None,
                         DTYPE_BYTES[plan.dtype] if fsdp else 4, plan.accum, plan.split_root)
    if plan.tp > 1:
        stage_cfg = replace(cfg, n_layers=n_layers)
        for k, v in tp_bytes_per_step(stage_cfg, plan.batch // plan.dp, plan.seq_len, plan.sequence_parallel,
                                      # the embedding's output: bf16 only where FSDP's policy casts the
                                      # parameters (dp > 1; apply_fsdp falls back to autocast otherwise)
                                      DTYPE_BYTES[plan.dtype], None if fsdp and plan.dp > 1 else 4,
                                      checkpointed, "tok_embeddings.weight" in shapes,
                                      "output.weight" in shapes).items():
            comm[k] = comm.get(k, 0) + v
        if "output.weight" in shapes and not plan.loss_parallel:
            # without loss parallelism the output layer gathers its logits whole on every TP rank
            # (train_3d.py's last stage): the batch's tokens x the vocabulary, in the compute dtype
            comm["all_gather"] = comm.get("all_gather", 0) + (
                DTYPE_BYTES[plan.dtype] * (plan.batch // plan.dp) * plan.seq_len * cfg.vocab_size)
        if plan.sequence_parallel and not (fsdp and plan.dp > 1):
            # the norm gains' gradients, left Partial by backward, summed once (reduce_partial_grads)
            comm["all_reduce (norm gains)"] = 4 * sum(math.prod(s) for k, s in shapes.items()
                                                      if k.endswith("norm.weight"))
    if plan.pp > 1:
        # the residual stream crosses the stages: fp32 under autocast and out of FSDP's root
        comm |= pp_bytes_per_step(cfg, plan.batch // plan.dp, plan.seq_len, plan.pp, stage, loops,
                                  v=plan.schedule in V_SCHEDULES)
    if plan.strategy == "ep":
        comm = ep_comm(plan, shapes, tokens)
    out["comm"] = comm
    return out


# ---- context parallelism (common/parallelize/cp.py) --------------------------------------------
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
               # DDP's buckets hold the gradients all step; FSDP accumulating, the unsharded ones
               + (out["transient"].get(ACCUM_GRADS, 0) if fsdp else out["gradients"])
               + sum(ring.values()) + sum(v for k, v in out["transient"].items() if "FSDP" in k)}
    if plan.world > 1 and not fsdp:  # DDP over every rank
        moments[DDP_REBUILD] = ddp_rebuild(out, 16 * seqs * local)
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
    from common.measure.byte_units import fmt_bytes
    from common.measure.memory_categories import STAGING
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
