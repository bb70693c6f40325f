"""The machines the step-time model (steptime.py) runs a layout on: a link's bandwidth and
latency, a GPU's spec sheet and the achieved fractions measured on one, and a machine that
``python -m tools.plan --calibrate`` measured (its cores, rates and links)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Link:
    """One kind of link: its bus bandwidth (bytes/s each way per GPU, what nccl-tests calls
    busbw) and the fixed time of one collective call (latency, seconds)."""
    bandwidth: float
    latency: float
    source: str = ""


@dataclass(frozen=True)
class Machine:
    name: str
    peak_flops: dict               # dtype -> FLOP/s, the spec sheet's dense rate
    achieved: dict                 # "eager" / "compiled" -> fraction of peak_flops a matmul-heavy step reaches
    hbm: float                     # bytes/s
    memory_gib: float              # what the card reports
    intra: Link                    # within a node (NVLink)
    inter: Link                    # across nodes (one NIC per GPU)
    gpus_per_node: int = 8
    source: str = ""
    calibrated_rate: dict = field(default_factory=dict)  # dtype -> FLOP/s measured here (--calibrate)
    # What the three fields below change is only what a CPU has: on every GPU description they
    # keep the model as it was (one unit a GPU, NCCL beside the compute, one achieved rate).
    units_per_node: int = 0        # compute units a node (CPU cores; 0: one per GPU, gpus_per_node)
    overlap: bool = True           # collectives run beside the compute (NCCL); gloo on a CPU runs
    #                                them on the cores that compute, so nothing hides under anything
    shape_rates: dict = field(default_factory=dict)  # shape_key(dtype, tp, seqs) -> FLOP/s of our
    #                                block at that shape, measured by --calibrate (one core)
    adamw_s_per_param: float = 0.0  # clipping + AdamW + zeroing, seconds a parameter, measured by
    #                                --calibrate (a CPU's AdamW runs a Python loop over tensors); 0: memory-bound
    dtensor_s_per_block: float = 0.0  # DTensor's dispatch under TP, seconds a block's forward + backward
    #                                of one micro-batch, measured by --calibrate; 0 on a GPU (hidden
    #                                behind the kernels it launches, and folded into the achieved fraction)

    def matmul_rate(self, dtype: str, compiled: bool = False, tp: int = 1, seqs: int | None = None) -> float:
        """FLOP/s one rank reaches on one unit: our block calibrated at this rank's shape (``tp``-way
        split heads and MLP, ``seqs`` sequences a (micro-)batch) where --calibrate measured it, else
        the calibrated rate, else the spec x the achieved fraction."""
        if seqs is not None and shape_key(dtype, tp, seqs) in self.shape_rates:
            return self.shape_rates[shape_key(dtype, tp, seqs)]
        if dtype in self.calibrated_rate:
            return self.calibrated_rate[dtype]
        key = "compiled" if compiled else "eager"
        return self.peak_flops[dtype] * self.achieved.get(f"{dtype} {key}", self.achieved[key])

    @property
    def units(self) -> int:
        return self.units_per_node or self.gpus_per_node

    def link(self, n: int, stride: int) -> tuple[Link, str]:
        """The link a ring of ``n`` ranks, ``stride`` apart in rank order, runs at.

        Inside a node: NVLink. A ring that leaves the node is as fast as the NICs its ranks
        on each node bring: k ranks a node (one NIC each) give it k x the NIC's bandwidth
        (NCCL runs a channel through each), never more than NVLink's."""
        per_node = max(1, min(n, self.gpus_per_node // stride)) if stride <= self.gpus_per_node else 1
        if per_node >= n:
            return self.intra, "in a node"
        bw = min(self.intra.bandwidth, per_node * self.inter.bandwidth)
        return Link(bw, self.inter.latency, self.inter.source), f"across nodes ({per_node} a node)"


# Achieved fractions: the share of the spec sheet's rate that makes this model's step equal a
# measured one (fraction_from_step: the FLOPs step_time counts, causal attention halved, over the
# time the step leaves after the model's other terms). Measured by tools/gpu_check.py on one H200
# (torch 2.11), figs/gpu_check_h200.md: the 1b model, batch 4 x 2048, eager bf16 autocast
# 154.7 ms a step (38.25% once the model's other terms are taken out, among them the optimizer's
# HBM traffic, clipping and foreach AdamW at 96 bytes a parameter: 19.5 ms at 4.8 TB/s; the report's MFU column, 6N + 12LdT a token over the
# whole step, says 35.6%), with --compile 116.2 ms (53.48%; 47.4%), and in fp32 (no TF32:
# PyTorch's default "highest" precision, which our scripts keep) 1,181.1 ms (65.72% of the 67
# TFLOP/s fp32 rate; 68.8%): matmuls on the CUDA cores run nearer their peak than bf16's on the
# tensor cores. No compiled fp32 step was
# measured, so compiled fp32 assumes the eager fraction. Those runs shared the GPU with the
# report's other parts (its note): their steps are upper bounds, these fractions lower ones.
# tests/test_plan.py recomputes them from the report. The H100 has the H200's compute (the same
# sheet, 989 and 67 TFLOP/s) and slower memory; it and the other GPU descriptions take these
# fractions unmeasured. Links: nccl-tests' busbw tops out near 80% of
# NVLink's rated speed and about 90% of InfiniBand's (assumed here; --calibrate measures yours).
ACHIEVED = {"eager": 0.3825, "compiled": 0.5348, "fp32 eager": 0.6572, "fp32 compiled": 0.6572}
NVLINK_FRACTION, IB_FRACTION = 0.80, 0.90
NVLINK_LATENCY, IB_LATENCY = 15e-6, 30e-6  # a small NCCL all-reduce's time in a node / across nodes (typical)
# InfiniBand NDR: 400 Gb/s = 50 GB/s each way per NIC, one NIC per GPU (NVIDIA ConnectX-7 / DGX H100 datasheet)
IB_NDR = Link(50e9 * IB_FRACTION, IB_LATENCY, "InfiniBand NDR 400 Gb/s = 50 GB/s each way (ConnectX-7), x0.9")

GPUS: dict[str, Machine] = {
    # NVIDIA H100 SXM datasheet: 989 TFLOP/s dense bf16, 67 fp32; HBM3 3.35 TB/s; NVLink 4 900 GB/s
    # both directions together (450 each way); an "80 GB" card reports 79.65 GiB (nvidia-smi 81559 MiB)
    "h100": Machine("H100 SXM 80GB", {"bf16": 989e12, "fp32": 67e12}, ACHIEVED, 3.35e12, 79.65,
                    Link(450e9 * NVLINK_FRACTION, NVLINK_LATENCY, "NVLink 4: 450 GB/s each way, x0.8"), IB_NDR,
                    source="NVIDIA H100 Tensor Core GPU datasheet (SXM5)"),
    # NVIDIA H200 datasheet: the H100's compute, HBM3e 4.8 TB/s, 141 GB (reports about 140 GiB)
    "h200": Machine("H200 SXM 141GB", {"bf16": 989e12, "fp32": 67e12}, ACHIEVED, 4.8e12, 140.0,
                    Link(450e9 * NVLINK_FRACTION, NVLINK_LATENCY, "NVLink 4: 450 GB/s each way, x0.8"), IB_NDR,
                    source="NVIDIA H200 Tensor Core GPU datasheet (SXM)"),
    # NVIDIA A100 SXM datasheet: 312 TFLOP/s dense bf16, 19.5 fp32; HBM2e 2.0 TB/s (80 GB); NVLink 3
    # 600 GB/s both ways (300 each way). Achieved fractions: the H200's, not measured on an A100.
    "a100": Machine("A100 SXM 80GB", {"bf16": 312e12, "fp32": 19.5e12}, ACHIEVED, 2.0e12, 80.0,
                    Link(300e9 * NVLINK_FRACTION, NVLINK_LATENCY, "NVLink 3: 300 GB/s each way, x0.8"), IB_NDR,
                    source="NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB)"),
    # torchtitan's benchmark machine (benchmarks/llama3_h100_202412_torchtitan.md, Grand Teton): H100s with 96 GB HBM2e at
    # 2.4 TB/s, a 500 W power limit, NVLink inside a host of 8, 400 Gb/s RDMA per GPU across hosts.
    # Its memory is counted like the 80 GB card's (96 x 79.65 / 80 = 95.6 GiB).
    "torchtitan": Machine("H100 96GB HBM2e, 500 W (torchtitan's)", {"bf16": 989e12, "fp32": 67e12},
                          ACHIEVED, 2.4e12, 95.6,
                          Link(450e9 * NVLINK_FRACTION, NVLINK_LATENCY, "NVLink 4: 450 GB/s each way, x0.8"),
                          IB_NDR, source="torchtitan benchmarks/llama3_h100_202412_torchtitan.md"),
}


def shape_key(dtype: str, tp: int, seqs: int) -> str:
    """How a calibration names one per-rank shape: the dtype, the TP split, sequences a (micro-)batch."""
    return f"{dtype} tp={tp} seqs={seqs}"


def load_calibration(path: str | Path) -> Machine:
    """The machine ``--calibrate`` measured (runs/calibration.json)."""
    c = json.loads(Path(path).read_text())
    link = Link(c["bandwidth_Bps"], c["latency_s"], f"measured: {c['backend']}, {c['world_size']} ranks")
    return Machine(c["name"], dict(c["matmul_flops"]), {"eager": 1.0, "compiled": 1.0},
                   c["memory_Bps"], c["memory_gib"], link, link, gpus_per_node=c["world_size"],
                   source=f"--calibrate on {c['date']}", calibrated_rate=dict(c["matmul_flops"]),
                   units_per_node=c.get("units", 0), overlap=c["backend"] != "gloo",
                   shape_rates={k: v["median"] for k, v in c.get("shapes_flops", {}).items()},
                   adamw_s_per_param=c.get("adamw_s_per_param", 0.0),
                   dtensor_s_per_block=c.get("dtensor_s_per_block", 0.0))
