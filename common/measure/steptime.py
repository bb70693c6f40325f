"""How long one training step takes, and where the time goes: the step-time model.

theory.py (adding up formulas.py) says how many bytes a layout holds and sends; this module turns a layout into
seconds on a machine, per rank, as a sum of named terms a learner can read:

  compute      the FLOPs the rank runs forward and backward, at the rate the device
               actually reaches on matmuls (``Machine.matmul_rate``: the spec sheet's dense
               rate x an achieved fraction, or this machine's calibrated rate). Per token and
               layer: 6 x the layer's matmul weights (multiply-add = 2 FLOPs, forward once,
               backward twice) and 6 x dim x seq for attention's QK^T and AV: half of the
               12 x dim x seq that MFU is usually quoted with (common/model.py's
               flops_per_token, PaLM's count), since a causal kernel skips the masked half.
               This is the model's one count (``model_flops_per_token``): the compute term,
               the MFU the planner prints and its "% of the rate assumed" (the share of the
               step the rank spends on these FLOPs) all use it. The output layer adds
               6 x vocab x dim on the last stage. TP divides a rank's share by tp, CP its
               tokens by cp, a pipeline stage keeps its own layers.
  recompute    activation checkpointing's extra forward. Full AC runs each checkpointed
               block's forward again in backward: a third of its compute. Our selective AC
               (common/parallelize/ac.py) keeps every matmul's and attention's output and
               recomputes only norms, RoPE, SiLU, the SwiGLU product and the residual adds:
               no matmul FLOPs, but memory-bound passes, counted as the bytes those ops
               read and write (formulas.py's activations dropped, twice) over HBM bandwidth.
               torchtitan's per-op selective AC (``--ac selective-op``; its published runs)
               recomputes those too, and every second matmul of a block (it saves the 1st,
               3rd, 5th and 7th of wq, wk, wv, wo, w1, w3, w2): wk, wo and w3's forward
               FLOPs again (``recompute_flops``, ``per_op_sac_flops``).
  exposed communication
               each collective's time on its link, t = calls x latency + bytes x ring factor
               / bandwidth (ring factors as nccl-tests' busbw: 2(n-1)/n for all-reduce,
               (n-1)/n for all-gather and reduce-scatter, 1 for send/recv and broadcast; the
               bytes are formulas.py's), less what hides under compute, as the scripts do it:
                 DDP: the buckets all-reduce during backward; the last one (the embedding's
                   gradient, ready last) waits: exposed = its time, plus what does not fit
                   under backward. ZeRO-1 adds the parameters' broadcast after the step:
                   issued asynchronously, one parameter at a time from its owner, and waited
                   for together: an all-gather's bytes and one latency, all exposed.
                 FSDP: each block's all-gather is prefetched during the previous block; the
                   first (the root unit and block 0) and the root's reduce-scatter at the end
                   of backward are exposed, plus whatever does not fit under compute.
                 TP: its all-reduces (or SP's all-gathers and reduce-scatters) sit between
                   the matmuls that need them: all exposed.
                 PP: the pipeline fills and drains: the first micro-batch's sends and, on
                   the way back, its gradients, (p-1) hops each way.
                 CP: the ring passes key/value blocks while attention computes on the one
                   it has: exposed only where the ring is slower than attention.
                 EP: the tokens' all-to-alls (dispatch and combine, forward and backward)
                   stand between the router and the experts: all exposed.
  bubble       a pipeline's idle share, from the schedule (common/parallelize/pp.py's
               bubble_formula: (p-1)/(m+p-1) for GPipe and 1F1B): idle = busy x b / (1 - b).
  optimizer    clipping and AdamW are memory-bound: bytes read and written per parameter
               this rank updates, over HBM bandwidth. Clipping reads every gradient for the
               norm and scales every one (read + write): 12 bytes. AdamW as the scripts run
               it on CUDA, PyTorch's default foreach path, is eight multi-tensor kernels over
               fp32 tensors (weight decay, the two moments, sqrt(v), its bias correction and
               eps, the update): 84 bytes; ``--fused-adamw`` (``fused=True``, one kernel) reads
               weight, gradient and both moments and writes weight and moments: 28. So 96
               bytes a parameter, or 40 fused (``ADAMW_BYTES``, by ``Plan.optimizer``;
               tests/test_claims.py counts them on the real optimizer). A calibrated CPU times
               it instead (clipping, AdamW's step and zeroing the gradients on our model's
               parameters): seconds a parameter, times the parameters this rank updates. Under
               ZeRO-1 a rank clips every gradient but updates 1/W of the parameters: the
               clipping's 12 bytes count for all of them.

  DTensor dispatch
               only on a calibrated CPU, under TP: DTensor's own work on every call (finding
               each op's sharding, wrapping and unwrapping), measured as our model's forward
               and backward with TP applied over one rank minus without, a block, times the
               blocks and micro-batches a rank runs. On a GPU it runs ahead of the kernels.
  waiting for a core
               only where ranks outnumber the node's compute units (4 ranks on 2 CPU cores;
               a GPU is one unit, so never on a GPU description): while every rank computes,
               each gets units/ranks of a unit, so its own work (compute, recompute,
               optimizer) costs ranks/units as long. A rank that waits gives its unit away:
               a pipeline's schedule is played with the units shared among the ranks that
               have work (pp.py:simulate_shared), and its bubble is only what that sharing
               cannot fill.

On a calibrated CPU (``--calibrate``), three more things are measured rather than assumed:
the rate is our block's own (matmuls, attention, norms and the rest, forward and backward)
timed at the shape each layout runs per rank (tp-way narrow heads and MLP, a micro-batch's
sequences: ``rank_shape``), on one core with the other cores busy; gloo's collectives run on
the cores that compute, so nothing overlaps anything (``Machine.overlap``); and the cores a
node has (``Machine.units_per_node``). On the GPU descriptions all three stay as they were.

What the model leaves out (the page says it too): kernel launch gaps and the harness's
own time (folded into the achieved fraction), communication slowing the compute it
overlaps (NCCL's kernels take SMs and HBM bandwidth), stragglers, the data loader, and
the first step's one-time work.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from common.measure.flops import attention_flops, head_flops, layer_flops, model_flops_per_token, recompute_flops
from common.measure.formulas import (DTYPE_BYTES, _dp_comm, checkpointed_blocks, cp_bytes_per_step, is_expert,
                                     layer_activation_bytes, pp_bytes_per_step, tp_bytes_per_step)
from common.measure.machines import Link, Machine
from common.measure.plan import Plan
from common.measure.splits import is_root, rank_shapes

GB = 1e9
DDP_BUCKET_BYTES = 25 * 2**20  # DDP's bucket_cap_mb default (torch.nn.parallel.DistributedDataParallel)
# Bytes read or written per parameter (fp32 tensors), counted on the real kernels by
# tests/test_claims.py. Clipping: the norm reads each gradient (4), the scaling reads and
# writes it (8): PyTorch scales every gradient, the factor clamped at 1, to avoid a host sync.
CLIP_BYTES = 12
# AdamW: foreach (CUDA's default) runs eight multi-tensor kernels, each reading and writing whole
# tensors: p *= 1 - lr wd (8); m.lerp_(g) (12); v *= b2 (8); v.addcmul_(g, g) (16: g passed
# twice); s = sqrt(v) (8); s /= sqrt(bias correction) (8); s += eps (8); p.addcdiv_(m, s) (16).
# The for-loop (a CPU's default) runs the same ops a tensor at a time; fused reads p, g, m, v
# and writes p, m, v in one kernel (28).
ADAMW_BYTES = {"foreach": 84, "for-loop": 84, "fused": 28}


def optimizer_bytes(kernels: str) -> int:
    """Bytes per parameter of clipping + AdamW's step with ``kernels`` (Plan.optimizer)."""
    return CLIP_BYTES + ADAMW_BYTES[kernels]


def ring_factor(op: str, n: int) -> float:
    """Bytes each rank's link carries per byte of the collective's size (nccl-tests' busbw / algbw)."""
    if n <= 1:
        return 0.0
    if op.startswith("all_reduce"):
        return 2 * (n - 1) / n
    if op.startswith(("all_gather", "reduce_scatter", "all_to_all")):
        return (n - 1) / n
    return 1.0  # send/recv, broadcast


# ---- one layout ---------------------------------------------------------------------------
@dataclass
class Comm:
    """One collective's share of a step."""
    name: str
    bytes: float
    group: int
    time: float
    exposed: float
    where: str
    between: str | None = None  # who talks, where "over <group>" would mislead (a ring's hops are pairwise)

    def row(self) -> str:
        who = self.between or f"over {self.group}"
        return f"{self.name} {who} ({self.where}): {self.time * 1e3:.1f} ms, {self.exposed * 1e3:.1f} exposed"


def collective_time(op: str, nbytes: float, n: int, link: Link, calls: int = 1) -> float:
    if n <= 1 or nbytes <= 0:
        return 0.0
    return calls * link.latency + nbytes * ring_factor(op, n) / link.bandwidth


def _comm(m: Machine, op: str, nbytes: float, n: int, stride: int, calls: int = 1) -> Comm:
    link, where = m.link(n, stride)
    return Comm(op, nbytes, n, collective_time(op, nbytes, n, link, calls), 0.0, where)


def rank_shape(plan: Plan) -> tuple[int, int]:
    """(tp, sequences) of the block one rank runs at a time: heads and MLP split tp ways, and a
    micro-batch's sequences (the pipeline's, or gradient accumulation's). What --calibrate times."""
    cp = plan.cp or plan.world if plan.strategy in ("cp", "cp_fsdp") else 1
    dp = plan.world // cp if cp > 1 else plan.dp
    return plan.tp, max(1, plan.batch // dp // ((plan.microbatches or plan.pp) if plan.pp > 1 else plan.accum))


def fraction_from_step(plan: Plan, step_s: float, machine: Machine, compiled: bool = False) -> float:
    """The achieved fraction of ``machine``'s sheet that makes step_time(``plan``) equal a
    measured step of ``step_s`` seconds: the time the FLOP-bound terms take at the sheet's
    full rate over what the measured step leaves them after the other terms (one rank: the
    optimizer's HBM time, selective AC's memory-bound recompute)."""
    full = step_time(plan, replace(machine, achieved={"eager": 1.0, "compiled": 1.0}, calibrated_rate={},
                                   shape_rates={}), compiled)
    flop_bound = full["compute"] + (full["recompute"] if plan.ac == "full" else 0.0)
    return flop_bound / (step_s - (full["step"] - flop_bound))


def step_time(plan: Plan, machine: Machine, compiled: bool = False) -> dict:
    """Predicted seconds per optimizer step of ``plan`` on ``machine``, by term, for the slowest rank.

    Returns {"compute", "recompute", "exposed communication", "bubble", "optimizer", "step"}
    plus "comm" (a list of Comm, each collective's total and exposed time), "tokens_per_s",
    "mfu" and "rate" (the matmul FLOP/s assumed)."""
    cfg, dtype = plan.cfg, plan.dtype
    cp = plan.cp or plan.world if plan.strategy in ("cp", "cp_fsdp") else 1
    dp = plan.world // cp if cp > 1 else plan.dp
    tp, pp = plan.tp, plan.pp
    seq_tokens = plan.batch // dp * plan.seq_len // cp  # tokens this rank's group runs a step (a pp stage: all of them)
    m = plan.microbatches or pp
    # the rate at the shape this rank runs (a calibrated CPU); one rate on a GPU
    rate = machine.matmul_rate(dtype, compiled, *rank_shape(plan))

    # compute, per pipeline stage (the slowest sets the pace); heads and MLP units split over tp
    stages = []
    for s in range(pp):
        rank = s * dp * tp
        shapes = rank_shapes(plan, rank) if cp == 1 else None
        n_layers = cfg.n_layers if shapes is None else sum(1 for k in shapes if k.endswith("attention_norm.weight"))
        last = shapes is None or "output.weight" in shapes
        per_token = n_layers * layer_flops(cfg, plan.seq_len) + (head_flops(cfg) if last else 0)
        k = checkpointed_blocks(n_layers, plan.ac, plan.ac_every)
        # --loss-chunks: backward runs the output projection again (2 FLOPs a weight a token)
        head_again = 2 * cfg.vocab_size * cfg.dim if last and plan.loss_chunks > 1 else 0
        stages.append((seq_tokens * per_token / tp / rate,
                       seq_tokens * (k * recompute_flops(cfg, plan.seq_len, plan.ac) + head_again) / tp / rate,
                       n_layers, k))
    compute, recompute, n_layers, k = max(stages, key=lambda x: x[0] + x[1])
    if plan.ac.startswith("selective") and k:  # memory-bound: the dropped tensors, written and read again
        dropped = layer_activation_bytes(cfg, seq_tokens, dtype, "none", tp, plan.sequence_parallel) - \
            layer_activation_bytes(cfg, seq_tokens, dtype, plan.ac, tp, plan.sequence_parallel)
        recompute += k * 2 * dropped / machine.hbm
    forward, backward = compute / 3, 2 * compute / 3 + recompute

    comms: list[Comm] = []
    shapes = rank_shapes(plan, 0) if cp == 1 else rank_shapes(replace(plan, strategy="ddp", world=1, cp=None), 0)
    if plan.strategy == "ep":  # FSDP gathers the dense part only; each rank keeps its experts whole
        shapes = {name: s for name, s in shapes.items() if not is_expert(name)}
    n_local = sum(math.prod(s) for s in shapes.values())
    kind = {"cp": "ddp", "cp_fsdp": "fsdp_zero3"}.get(plan.strategy, plan.dp_kind)
    fsdp = kind.startswith(("fsdp", "hsdp"))

    # data parallelism over dp (or, under CP, every rank), stride tp: its bytes from formulas.py
    group = plan.world if cp > 1 else dp
    if group > 1 and kind != "single":
        shard = plan.shard if kind.startswith("hsdp") else None
        b = _dp_comm(kind if kind != "hsdp" else "hsdp_zero3", shapes, group, shard,
                     DTYPE_BYTES[dtype] if fsdp else 4, plan.accum)
        stride = tp
        if not fsdp:  # DDP, ZeRO-1: buckets all-reduced under backward, the last one exposed
            c = _comm(machine, "all_reduce", b["all_reduce"], group, stride,
                      calls=max(1, math.ceil(b["all_reduce"] / DDP_BUCKET_BYTES)))
            embedding = 4 * math.prod(shapes.get("tok_embeddings.weight", (0,)))
            last = min(b["all_reduce"], max(DDP_BUCKET_BYTES, embedding))
            t_last = collective_time("all_reduce", last, group, machine.link(group, stride)[0])
            c.exposed = t_last + max(0.0, c.time - t_last - backward)
            comms.append(c)
            if "broadcast" in b:  # ZeRO-1: each rank's updated partition, to every other, after the step.
                # ZeroRedundancyOptimizer._sync_params broadcasts parameter by parameter from its
                # owner, all asynchronously, then waits for them all: together an all-gather's
                # traffic ((n-1)/n of the parameters into each rank), the calls' latencies overlapping
                # (one paid). Nothing left to hide it under: exposed.
                link = machine.link(group, stride)[0]
                c = Comm("broadcast", b["broadcast"], group,
                         collective_time("all_gather", b["broadcast"], group, link), 0.0, machine.link(group, stride)[1])
                c.exposed = c.time
                comms.append(c)
        else:  # FSDP: one all-gather a unit forward (and again backward, resharded), one reduce-scatter
            sg = plan.shard if kind.startswith("hsdp") else group  # the FSDP (shard) group, ranks stride apart
            link = machine.link(sg, stride)[0]
            pbytes = DTYPE_BYTES[dtype]  # FSDP gathers the compute dtype's copy (its MixedPrecisionPolicy)
            root = sum(math.prod(s) for name, s in shapes.items() if is_root(name))
            block = (n_local - root) / max(1, n_layers)
            again = kind.endswith("zero3") or kind == "hsdp"  # zero2 keeps the gathered blocks for backward

            def t(op, numel, width, calls=1):  # ``calls`` collectives of ``numel`` elements each
                return collective_time(op, calls * numel * width, sg, link, calls)
            gather_fwd = t("all_gather", root, pbytes) + t("all_gather", block, pbytes, n_layers)
            gather_bwd = t("all_gather", block, pbytes, n_layers) if again else 0.0
            # --split-root-unit: the embedding's unit is gathered again for backward under ZeRO-3, as a
            # block's is, and it is the one reduced last (the head's as soon as backward leaves it)
            emb = math.prod(shapes.get("tok_embeddings.weight", (0,)))
            gather_bwd += t("all_gather", emb, pbytes) if plan.split_root and again else 0.0
            last = first_unit = emb if plan.split_root else root  # the head's own unit is gathered last in forward
            first = t("all_gather", first_unit, pbytes) + t("all_gather", block, pbytes)  # nothing to hide it under
            ag = _comm(machine, "all_gather", b["all_gather"], sg, stride)
            ag.time = gather_fwd + gather_bwd
            ag.exposed = first + max(0.0, gather_fwd - first - forward)
            rs = _comm(machine, "reduce_scatter", b["reduce_scatter"], sg, stride)
            rs.time = t("reduce_scatter", root, 4) + t("reduce_scatter", block, 4, n_layers)
            under_backward = gather_bwd + rs.time - t("reduce_scatter", last, 4)
            extra = []
            if "all_reduce" in b:  # HSDP: the replicas all-reduce each reduced shard, under backward too
                ar = _comm(machine, "all_reduce", b["all_reduce"], group // sg, sg * stride, calls=n_layers + 1)
                under_backward += ar.time
                extra.append(ar)
            # the root unit (embedding, output; with --split-root-unit the embedding's) is reduced
            # last, after backward: exposed; so is whatever did not fit under backward (charged to
            # the reduce-scatter)
            rs.exposed = t("reduce_scatter", last, 4) + max(0.0, under_backward - backward)
            comms += [ag, rs, *extra]
            norm = _comm(machine, "all_reduce (grad norm)", b["all_reduce (grad norm)"], group, stride)
            norm.exposed = norm.time
            comms.append(norm)
    if tp > 1:  # on the critical path: every one waits for the matmul before it and holds up the next
        stage_cfg = replace(cfg, n_layers=n_layers)
        for op, v in tp_bytes_per_step(stage_cfg, plan.batch // dp, plan.seq_len, plan.sequence_parallel,
                                       DTYPE_BYTES[dtype], None if fsdp and dp > 1 else 4, k).items():
            c = _comm(machine, op, v, tp, 1, calls=4 * n_layers + 2 + k)
            c.exposed = c.time
            comms.append(c)
        if plan.sequence_parallel and not (fsdp and dp > 1):  # the norm gains' Partial gradients, summed once
            gains = [math.prod(s) for name, s in shapes.items() if name.endswith("norm.weight")]
            c = _comm(machine, "all_reduce (norm gains)", 4 * sum(gains), tp, 1, calls=len(gains))
            c.exposed = c.time
            comms.append(c)
    bubble = 0.0
    if pp > 1:
        from common.parallelize.pp import bubble_formula
        busy = compute + recompute
        b = bubble_formula(plan.schedule, pp, m)
        bubble = busy * b / (1 - b)
        act = pp_bytes_per_step(cfg, plan.batch // dp, plan.seq_len, pp, 0)["send"]  # one boundary, one way
        c = _comm(machine, "send/recv", 2 * act, 2, tp * dp, calls=2 * m)
        # the fill and the drain: micro-batch 0's activations down (p-1) hops, its gradient back up
        c.exposed = 2 * (pp - 1) * collective_time("send", act / m, 2, machine.link(2, tp * dp)[0])
        comms.append(c)
    if cp > 1:  # the ring under attention: exposed only where it is slower than attention
        ring = cp_bytes_per_step(cfg, plan.batch // dp, plan.seq_len, cp, DTYPE_BYTES[dtype],
                                 checkpointed_blocks(cfg.n_layers, plan.ac, plan.ac_every))["send"]
        c = _comm(machine, "send/recv (CP ring)", ring, 2, 1,
                  calls=cfg.n_layers * 3 * (cp - 1))
        c.between = f"around a ring of {cp}, each rank to its neighbour"  # priced as pairs: one hop at a time
        attention = seq_tokens * cfg.n_layers * attention_flops(cfg, plan.seq_len) / rate
        c.exposed = max(0.0, c.time - attention)
        comms.append(c)
    if plan.strategy == "ep":  # the tokens' all-to-alls: dispatch and combine, forward and backward,
        # between the router and the experts that wait for them: nothing to hide under
        from common.parallelize.ep import ep_bytes_per_step
        ep = plan.ep or plan.world
        c = _comm(machine, "all_to_all", ep_bytes_per_step(cfg, seq_tokens, act_bytes=DTYPE_BYTES[dtype],
                                                           accum=plan.accum), ep, 1, calls=4 * cfg.n_layers)
        c.exposed = c.time
        comms.append(c)
    if not machine.overlap:  # gloo: the collectives run on the cores that compute, nothing hides
        for c in comms:
            c.exposed = c.time
    exposed = sum(c.exposed for c in comms)

    # the optimizer: clipping reads and scales every gradient the rank holds (its shards under FSDP,
    # all of them under ZeRO-1), AdamW updates the parameters it owns (splits.py's shards)
    clipped = n_local / ((plan.shard if kind.startswith("hsdp") else group) if fsdp else 1)
    updated = clipped / (group if kind == "zero1" else 1)
    per_byte = machine.adamw_s_per_param / optimizer_bytes(plan.optimizer) if machine.adamw_s_per_param \
        else 1 / machine.hbm
    optimizer = (clipped * CLIP_BYTES + updated * ADAMW_BYTES[plan.optimizer]) * per_byte

    # More ranks on a node than compute units (4 ranks on 2 CPU cores): the ranks take turns.
    # Everything above runs at one unit's rate; while all ranks compute, each gets units/ranks
    # of one, so every second of its own work costs ranks/units ("waiting for a core"). A rank
    # that waits (a pipeline's bubble) gives its unit to the others: the bubble is what is
    # left of a schedule played with the units shared among the ranks that have work
    # (common/parallelize/pp.py:simulate_shared), beyond the shared work itself. With ranks
    # <= units (every GPU description) this term is 0 and the bubble is the formula's.
    # DTensor's own Python on the CPU, a block's forward and backward per micro-batch
    dispatch = machine.dtensor_s_per_block * n_layers * (m if pp > 1 else plan.accum) if tp > 1 else 0.0

    share = min(plan.world, machine.gpus_per_node) / machine.units
    waiting = 0.0
    if share > 1:
        busy = compute + recompute
        waiting = (busy + optimizer + dispatch) * (share - 1)
        if pp > 1:
            from common.parallelize.pp import simulate_shared
            span = simulate_shared(plan.schedule, pp, m, compute / 3 / m, (2 * compute / 3 + recompute) / m,
                                   units=machine.units * pp / min(plan.world, machine.gpus_per_node))
            bubble = max(0.0, span - busy * share)

    step = compute + recompute + exposed + bubble + optimizer + dispatch + waiting
    tokens = plan.batch * plan.seq_len
    return {"compute": compute, "recompute": recompute, "exposed communication": exposed, "bubble": bubble,
            "optimizer": optimizer, DISPATCH: dispatch, SHARED: waiting, "step": step, "comm": comms, "tokens_per_s": tokens / step,
            "tokens_per_s_per_gpu": tokens / step / plan.world, "rate": rate,
            # MFU against the spec sheet (None for a calibrated machine: its "peak" is what it reached),
            # and against the rate assumed, in the compute term's count: the share of the step the
            # rank spends on the model's FLOPs (communication, bubble, optimizer and recompute are
            # the rest; not counting the recompute is MFU's convention)
            "mfu": None if machine.calibrated_rate else
            model_flops_per_token(cfg, plan.seq_len) * tokens / step / (plan.world * machine.peak_flops[dtype]),
            "mfu_of_rate": model_flops_per_token(cfg, plan.seq_len) * tokens / step / (plan.world * rate)}


TERMS = ("compute", "recompute", "exposed communication", "bubble", "optimizer")
# Only on a calibrated CPU: DTensor's per-call work under TP, and ranks outnumbering cores (see step_time)
DISPATCH, SHARED = "DTensor dispatch", "waiting for a core"
ALL_TERMS = (*TERMS, DISPATCH, SHARED)


def explain(t: dict) -> str:
    """One line: the step and its terms, then each collective's total and exposed time."""
    terms = ", ".join(f"{k} {t[k] * 1e3:,.1f}" for k in ALL_TERMS if t[k] > 0)
    mfu = f"MFU {t['mfu']:.1%} of the spec sheet, " if t["mfu"] is not None else "MFU "
    lines = [f"step {t['step'] * 1e3:,.1f} ms = {terms} (ms); {mfu}{t['mfu_of_rate']:.0%} of the rate assumed"]
    lines += ["    " + c.row() for c in t["comm"]]
    return "\n".join(lines)

