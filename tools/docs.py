"""The walkthrough's files: README.md (the map) and one README per chapter beside its
scripts. The figures command fills their generated blocks, the tests read their commands."""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a file (python tools/x.py): find common/

from common import ROOT

DOCS = ["README.md", "step1_single_gpu/README.md", "step2_memory/README.md", "step3_multi_gpu/README.md",
        "step3_multi_gpu/comm_lab.md", "step3_multi_gpu/model_parallel.md",
        "step3_multi_gpu/context_parallel.md", "step3_multi_gpu/expert_parallel.md",
        "step3_multi_gpu/will_it_fit.md", "step3_multi_gpu/deepspeed.md",
        "step4_multi_node/README.md"]


def doc_paths() -> list[Path]:
    return [ROOT / d for d in DOCS if (ROOT / d).exists()]


def all_text() -> str:
    """Every walkthrough file, one after another (for checks that do not care which)."""
    return "\n".join(p.read_text() for p in doc_paths())


def block(name: str) -> tuple[Path, str] | None:
    """(the file holding <!-- BEGIN name --> ... <!-- END name -->, the text between), or None."""
    begin, end = f"<!-- BEGIN {name} -->", f"<!-- END {name} -->"
    for p in doc_paths():
        text = p.read_text()
        if begin in text and end in text:
            return p, text.split(begin, 1)[1].split(end, 1)[0]
    return None


def untimed(text: str) -> str:
    """A tool's block less the time its command took ("(traced ... in 9.2 s)"), which moves
    with the machine's load: regenerating a block whose only change is that time keeps the
    page as it is (tools/figures.py), and the test of the estimator's blocks ignores it."""
    return re.sub(r"in [\d.]+ s\)", "in ... s)", text.strip())


# ---- the numbers the prose quotes ---------------------------------------------------------
# A number the prose takes from a run, an estimate, a plan or a GPU report sits between
# <!-- v:NAME --> and <!-- /v -->, and VALUES[NAME] renders it from that source: a block of
# these pages (which the figures command writes first), a report in figs/, a file the number
# belongs to (train.slurm) or the constant the code runs with. The figures command fills them
# after writing its blocks (and `python -m tools.docs` alone), so a regenerated block carries
# its numbers into the sentences that quote it instead of leaving a stale copy behind;
# tests/test_docs.py fails on a value that differs from its source or a name not listed here.
VALUE = re.compile(r"<!-- v:([\w.-]+) -->(.*?)<!-- /v -->", re.S)


def _text(name: str) -> str:
    found = block(name)
    if found is None:
        raise LookupError(f"no page has the block {name}")
    return found[1]


def _grab(name: str, pattern: str) -> str:
    """The first group of ``pattern`` in block ``name`` (a block whose shape changed says so)."""
    m = re.search(pattern, _text(name), re.M)
    if m is None:
        raise LookupError(f"the block {name} no longer holds {pattern!r}")
    return m.group(1)


def _num(s: str) -> float:
    """The number in a cell: '**223.1**', '1,580', '18.15 GiB (H200 tracer)', '-1.3%'."""
    m = re.search(r"-?[\d,]*\.?\d+", s)
    if m is None:
        raise ValueError(f"no number in {s!r}")
    return float(m.group(0).replace(",", ""))


def _cell(name: str, row: str, column: str | int) -> str:
    """The cell of a markdown table in block ``name``: the row whose first cell starts with
    ``row``, the column by its header (the first of that name) or its index."""
    rows = [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in _text(name).splitlines() if line.startswith("|")]
    i = column if isinstance(column, int) else rows[0].index(column)
    for cells in rows[2:]:
        if cells[0].startswith(row):
            return cells[i]
    raise LookupError(f"the block {name} has no row {row!r}")


def _est(name: str, row: str, column: int = 1, answer: int = 0) -> float:
    """A number of the estimator's text output in block ``name`` (its ``answer``-th, where the
    block holds several, a blank line apart): the first line that starts with ``row``, its
    ``column``-th field (fields are two or more spaces apart; 0 is the row's name)."""
    for line in _text(name).split("\n\n")[answer].splitlines():
        if line.strip().startswith(row):
            return _num(re.split(r"\s{2,}", line.strip())[column])
    raise LookupError(f"the block {name} has no row {row!r}")


def _seconds(name: str, what: str = "dry run") -> float:
    """How long the command of block ``name`` took, as its first lines print it."""
    head = {"dry run": r"\(dry run of rank \d+: .* in ([\d.]+) s", "trace": r"\(traced rank \d+ .* in ([\d.]+) s\)"}
    return float(_grab(name, head[what]))


def _gpu_report() -> dict:
    return json.loads((ROOT / "figs" / "gpu_check_h200.json").read_text())


def _gpu_run(name: str) -> dict:
    return next(r for r in _gpu_report()["runs"] if r["name"] == name)


H200_LOGS = ROOT / "figs" / "h200_2026-11-26"
NANOGPT_MS = {"eager": 32.53, "compiled": 26.38}  # figs/h200_2026-11-26/README.md: nanoGPT's bench.py there


def _h200(log: str, pattern: str) -> float:
    """A number from one of the H200 session's logs in figs/h200_2026-11-26/."""
    m = re.search(pattern, (H200_LOGS / log).read_text())
    if m is None:
        raise LookupError(f"figs/h200_2026-11-26/{log} has nothing like {pattern!r}")
    return float(m.group(1).replace(",", ""))


def _h200_ms(which: str) -> float:
    return _h200({"eager": "ours_eager.log", "compiled": "ours_compile_trace.log"}[which], r"([\d.]+) ms/step")


def _usable(name: str) -> float:
    """The GiB an estimator block counts as usable (the GPU less its headroom)."""
    return _num(_grab(name, r"fits(?: = peak <=| in) ([\d.]+) GiB"))


def _dry8b(which: str) -> float:
    """The 8b dry run's allocator on the H200: its peak allocated or reserved GiB."""
    return _h200("dry8b.log", {"allocated": r"peak ([\d.]+) GiB allocated", "reserved": r"([\d.]+) GiB reserved"}[which])


def _slurm(pattern: str) -> str:
    """What step4_multi_node/train.slurm says (the pages quote its flags)."""
    m = re.search(pattern, (ROOT / "step4_multi_node" / "train.slurm").read_text(), re.M)
    if m is None:
        raise LookupError(f"step4_multi_node/train.slurm no longer holds {pattern!r}")
    return m.group(1)


def _range(cell: str) -> list[float]:
    """'3.33 MiB – 10.84 MiB' -> [3.33, 10.84] (a table's range over the ranks)."""
    return [_num(part) for part in cell.split("–")]


def _achieved(kind: str) -> str:
    from common.measure.machines import ACHIEVED
    return f"{ACHIEVED[kind]:.2%}"


def _tt(row: str, column: str) -> str:
    """plan-torchtitan's cell: torchtitan's published run ``row`` against our prediction."""
    return _cell("plan-torchtitan", row, column)


def _plan_row(name: str, i: int) -> list[str]:
    """Row ``i`` (1-based) of a planner block's table."""
    for line in _text(name).splitlines():
        if line.startswith(f"| {i} |"):
            return [c.strip() for c in line.strip().strip("|").split("|")]
    raise LookupError(f"the block {name} has no row {i}")


def _ordinal(cell: str) -> str:
    """'5 of 30' -> '5th'."""
    n = int(_num(cell))
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def _gib(x: float, digits: int = 2) -> str:
    return f"{x:.{digits}f} GiB"


def _pct_under(ratio: str) -> str:
    """'0.83' (ours/theirs) -> '17%' (how far under)."""
    return f"{round((1 - _num(ratio)) * 100):.0f}%"


_DRY = "est-dry-run-1b", "est-dry-run-8b"
_TT8, _TT8C, _TT128, _TT128C = ("Table 1: FSDP, eager", "Table 1: FSDP + compile", "Table 3: FSDP, eager",
                                "Table 3: FSDP + compile")
_TP = "asyncTP benchmark"
VALUES = {
    # the H200 session's own logs (figs/h200_2026-11-26/): 125m against nanoGPT, the 8b dry run's allocator
    "h200.ours-eager-ms": lambda: f"{_h200_ms('eager'):.1f} ms",
    "h200.ours-compiled-ms": lambda: f"{_h200_ms('compiled'):.1f} ms",
    "h200.nanogpt-eager-ms": lambda: f"{NANOGPT_MS['eager']:.2f} ms",
    "h200.nanogpt-compiled-ms": lambda: f"{NANOGPT_MS['compiled']:.2f} ms",
    "h200.eager-ratio": lambda: f"{_h200_ms('eager') / NANOGPT_MS['eager']:.2f}x",
    "h200.compiled-ratio": lambda: f"{_h200_ms('compiled') / NANOGPT_MS['compiled']:.2f}x",
    "h200.dry8b-allocated": lambda: f"{_dry8b('allocated'):.2f} GiB",
    "h200.dry8b-peak": lambda: f"{_h200('dry8b.log', r'dry run peak ([0-9.]+) GiB'):.2f} GiB",
    "h200.dry8b-activations": lambda: f"{_h200('dry8b.log', r'activations +[0-9.]+ +([0-9.]+)'):.2f} GiB",
    "h200.dry8b-other": lambda: f"{_h200('dry8b.log', r'other .measured: temporaries. +([0-9.]+)'):.2f} GiB",
    "h200.dry8b-reserved": lambda: f"{_dry8b('reserved'):.2f} GiB",
    "h200.dry8b-ratio": lambda: f"{_dry8b('reserved') / _dry8b('allocated'):.2f}x",
    # README.md: what the default figures command makes, the GPU report, the Slurm script
    "dry-run-1b.time": lambda: f"{_seconds(_DRY[0]):.1f} s",
    "dry-run-8b.time": lambda: f"{_seconds(_DRY[1]):.1f} s",
    "dry-runs.minutes": lambda: f"{round(sum(map(_seconds, _DRY)) / 60)} minutes",
    "gpu.made": lambda: f"one {_gpu_report()['device']} on {_gpu_report()['date']}",
    "gpu.trace-cost": lambda: _grab("gpu-check", r"against a run without it: ([\d.]+x)"),
    "gpu.failed": lambda: (lambda runs: f"{sum(not r['ok'] for r in runs)} of its {len(runs)} runs")(
        _gpu_report()["runs"]),
    # step 2: the H200's checkpointed 1b rows, whose allocator held earlier runs' model state too
    "gpu.1b-ac-allocated": lambda: f"{_gpu_run('1b_amp_ac')['allocator_peak_bytes'] / GiB:.1f} GiB",
    "gpu.1b-ac-traced": lambda: f"{_gpu_run('1b_amp_ac')['traced_peak_bytes'] / GiB:.1f}",
    "gpu.1b-sac-gap": lambda: f"{_gap('1b_amp_sac') / GiB:.3f} GiB",
    "gpu.1b-params": lambda: f"{_n_1b():,}",
    "gpu.1b-sac-rest": lambda: f"{(_gap('1b_amp_sac') - 12 * _n_1b()) / GiB:.3f} GiB",
    "gpu.failed-names": lambda: ", ".join(f"`{r['name']}`" for r in _gpu_report()["runs"] if not r["ok"]),
    "slurm.shutdown-timeout": lambda: _slurm(r"--shutdown-timeout (\d+)"),
    "slurm.warning": lambda: _slurm(r"--signal=B:USR1@(\d+)"),
    # step 1
    "table-01.first-loss": lambda: "{:.1f}".format(_num(_grab("table-01", r"loss ([\d.]+) ->"))),
    "table-01.last-loss": lambda: "{:.1f}".format(_num(_grab("table-01", r"-> ([\d.]+) in"))),
    # step 2: the savers side by side (table-02)
    "02.base.act": lambda: _s2("base", "activations", "{:.0f} MiB"),
    "02.base.other": lambda: _s2("base", "other", "{:.0f} MiB"),
    "02.base.grads": lambda: _s2("base", "gradients", "{:.0f} MiB"),
    "02.base.peak": lambda: _s2("base", "peak", "{:.0f} MiB"),
    "02.amp.act": lambda: _s2("amp", "activations", "{:.1f} MiB"),
    "02.amp.other": lambda: _s2("amp", "other", "{:.0f} MiB"),
    "02.amp.peak": lambda: _s2("amp", "peak", "{:.1f} MiB"),
    "02.amp.act-ratio": lambda: "{:.2f}".format(_s2_num("amp", "activations") / _s2_num("base", "activations")),
    "02.amp.time-vs": lambda: _s2("amp", "step time vs baseline", "{:.2f}"),
    "02.amp.time": lambda: _s2("amp", "step time", "{:.0f} ms"),
    "02.ac.act": lambda: _s2("ac", "activations", "{:.0f} MiB"),
    "02.ac.other": lambda: _s2("ac", "other", "{:.0f} MiB"),
    "02.ac.grads": lambda: _s2("ac", "gradients", "{:.0f} MiB"),
    "02.ac.peak": lambda: _s2("ac", "peak", "{:.0f} MiB"),
    "02.ac.vs": lambda: _s2("ac", "peak vs baseline", "{:.2f}"),
    "02.ac.time": lambda: _s2("ac", "step time", "{:.0f}"),
    "02.ac.time-over-amp": lambda: "{:.2f}".format(_s2_num("ac", "step time") / _s2_num("amp", "step time")),
    "02.ac.flops": lambda: _s2("ac", "matmul FLOPs vs baseline", "{:.2f}"),
    "02.sac.act": lambda: _s2("sac", "activations", "{:.0f} MiB"),
    "02.sac.other": lambda: _s2("sac", "other", "{:.0f} MiB"),
    "02.sac.peak": lambda: _s2("sac", "peak", "{:.0f} MiB"),
    "02.sac.vs": lambda: _s2("sac", "peak vs baseline", "{:.2f}"),
    "02.sac.time": lambda: _s2("sac", "step time", "{:.0f} ms"),
    "02.sac.time-over-amp": lambda: "{:.2f}".format(_s2_num("sac", "step time") / _s2_num("amp", "step time")),
    "02.accum.act": lambda: _s2("accum", "activations", "{:.0f} MiB"),
    "02.accum.peak": lambda: _s2("accum", "peak", "{:.0f} MiB"),
    "02.accum.vs": lambda: _s2("accum", "peak vs baseline", "{:.2f}"),
    "02.accum.grads": lambda: _s2("accum", "gradients", "{:.1f} MiB"),
    "02.accum.time-vs": lambda: _s2("accum", "step time vs baseline", "{:.2f}"),
    "02.all.peak": lambda: _s2("all", "peak", "{:.0f} MiB"),
    "02.all.vs": lambda: _s2("all", "peak vs baseline", "{:.2f}"),
    "02.all.time-vs": lambda: _s2("all", "step time vs baseline", "{:.2f}"),
    "02.all.floor": lambda: "{:.0f}".format(sum(_s2_num("all", c) for c in ("parameters", "gradients", "optimizer state"))),
    "02.all.params": lambda: _s2("all", "parameters", "{:.1f} MiB"),
    "02.all.grads": lambda: _s2("all", "gradients", "{:.1f} MiB"),
    "02.all.adamw": lambda: _s2("all", "optimizer state", "{:.0f} MiB"),
    # step 2: float8 beside AMP (table-02-float8)
    "f8.gap": lambda: _cell("table-02-float8", "float8 + bf16", "largest loss gap to bf16"),
    "f8.act-under": lambda: f"{_f8_act('AMP bf16') - _f8_act('float8 + bf16'):.0f} MiB",
    "f8.peak-over": lambda: "{:.1%}".format(_num(_cell("table-02-float8", "float8 + bf16", "peak"))
                                            / _num(_cell("table-02-float8", "AMP bf16", "peak")) - 1),
    "f8.alloc-peak-over": lambda: "{:.1%}".format(_num(_cell("table-02-float8", "float8 + bf16", "allocator's peak"))
                                                  / _num(_cell("table-02-float8", "AMP bf16", "allocator's peak")) - 1),
    "f8.unseen": lambda: re.search(r"\(([\d.]+ \w?i?B) unseen\)",
                                   _cell("table-02-float8", "float8 + bf16", "allocator's peak")).group(1),
    "f8.overstate": lambda: "{:.0%}".format(_f8_predicted() / _f8_act("float8 + bf16") - 1),
    "f8.amp-match": lambda: "{:.1%}".format(abs(_f8_predicted() / _f8_act("AMP bf16") - 1)),
    "f8.predicted": lambda: f"{_f8_predicted():.1f}",
    "f8.act": lambda: f"{_f8_act('float8 + bf16'):.1f} MiB",
    # step 3a: the ZeRO runs
    "table-03a.zero3-peak": lambda: f"{_num(_cell('table-03a', 'FSDP ZeRO-3', 'peak per rank')):.0f}",
    "table-03a.bf16-ac-peak": lambda: f"{_num(_cell('table-03a', 'FSDP ZeRO-3, bf16', 'peak per rank')):.0f}",
    "table-03a.sharded-state": lambda: f"{_num(_cell('table-03a', 'FSDP ZeRO-3', 3)):.1f} MiB",
    # ZeRO-1 on the wire: DDP's ring all-reduce plus, on average, (W-1)/W of the broadcast
    "table-03a.zero1-wire": lambda: f"{_zero1_wire():.1f} MiB",
    "table-03a.ddp-wire": lambda: f"{_num(_cell('table-03a', 'DDP', 'a ring sends')):.1f} MiB",
    "table-03a.zero1-over-ddp": lambda: f"{_zero1_wire() / _num(_cell('table-03a', 'DDP', 'a ring sends')):.1f}",
    # will_it_fit.md: the 8b preset on 4 GPUs
    "est-8b.card": lambda: _gib(_num(_grab("est-8b", r"usable \(([\d.]+) GiB less"))),
    "est-8b.usable": lambda: "{:.2f}".format(_num(_grab("est-8b", r"fits = peak <= ([\d.]+) GiB"))),
    "est-8b.ddp-state": lambda: _gib(sum(_num(_cell("est-8b", "ddp on 4", c))
                                         for c in ("parameters", "gradients", "AdamW state")), 0),
    "est-8b.single-peak": lambda: _gib(_num(_cell("est-8b", "single device", "peak"))),
    "est-8b.single-state": lambda: _gib(sum(_num(_cell("est-8b", "single device", c))
                                            for c in ("parameters", "gradients", "AdamW state")), 0),
    "est-8b.single-temporaries": lambda: _gib(_num(_cell("est-8b", "single device", "peak"))
                                              - sum(_num(_cell("est-8b", "single device", c))
                                                    for c in ("parameters", "gradients", "AdamW state")), 0),
    "est-8b.zero1-adamw": lambda: _gib(_num(_cell("est-8b", "zero1 on 4", "AdamW state")), 0),
    "est-8b.zero1-peak": lambda: _gib(_num(_cell("est-8b", "zero1 on 4", "peak"))),
    "est-8b.zero3-peak": lambda: _gib(_num(_cell("est-8b", "fsdp_zero3 on 4", "peak"))),
    "est-8b.zero3-spare": lambda: _gib(_num(_grab("est-8b", r"fits = peak <= ([\d.]+) GiB"))
                                       - _num(_cell("est-8b", "fsdp_zero3 on 4", "peak")), 0),
    "est-8b-ac.zero1-peak": lambda: _gib(_num(_cell("est-8b-ac", "zero1 on 4", "peak"))),
    # context_parallel.md: the 1b model's activations against its model state (est-cp's first answer)
    "est-cp.single-act": lambda: _gib(_est("est-cp", "activations")),
    "est-cp.single-state": lambda: _gib(sum(_est("est-cp", c) for c in ("parameters", "gradients", "optimizer state"))),
    # the 1b model on one GPU, at the batch the GPU runs measured
    "est-1b.batch": lambda: _grab("est-1b", r"batch (\d+ x \d+) tokens"),
    "est-1b.peak": lambda: _gib(_est("est-1b", "peak (")),
    "est-1b.peak-ac": lambda: _gib(_est("est-1b", "peak (", answer=1)),
    "est-1b.autocast-copies": lambda: _gib(_est("est-1b", "autocast weight copies", answer=1)),
    "fit-1b.full-ac-formula": lambda: _cell("fit-gpu-1b", "bf16 + full AC", "formula (cuda)"),
    "fit-1b.full-ac-gpu": lambda: _gib(_num(_cell("fit-gpu-1b", "bf16 + full AC", "GPU"))),
    "fit-1b.bf16-off": lambda: _cell("fit-gpu-1b", "bf16 autocast", "off"),
    "fit-1b.fp32-off": lambda: _cell("fit-gpu-1b", "fp32", "off"),
    # chapter 3's strategies side by side
    "compare.fsdp-sent": lambda: _cell("table-03-compare", "FSDP", "sent per step per rank"),
    "compare.ddp-sent": lambda: _cell("table-03-compare", "DDP", "sent per step per rank"),
    "compare.fsdp-over-ddp": lambda: "{:.0f}x".format(_num(_cell("table-03-compare", "FSDP", "sent per step per rank"))
                                                      / _num(_cell("table-03-compare", "DDP", "sent per step per rank"))),
    # the fake-tensor traces: how long, and the traced peak over the formula's (CUDA's kernels,
    # then the CPU's, which the trace runs)
    "trace-debug.time": lambda: f"{_seconds('est-trace-debug', 'trace'):.1f} s",
    "trace-8b.time": lambda: f"{_seconds('est-trace-8b', 'trace'):.1f} s",
    "trace-debug.ratio": lambda: f"{_est('est-trace-debug', 'peak (', 3):.3f}",
    "trace-8b.ratio": lambda: f"{_est('est-trace-8b', 'peak (', 3):.3f}",
    "trace-pp.ratio": lambda: f"{_est('est-trace-pp', 'peak (', 3):.3f}",
    "trace-debug.cpu-ratio": lambda: _grab("est-trace-debug", r"CPU's kernels.*\(trace/formula ([\d.]+)\)"),
    "trace-8b.cpu-ratio": lambda: _grab("est-trace-8b", r"CPU's kernels.*\(trace/formula ([\d.]+)\)"),
    "trace-tt.cpu-ratio": lambda: _grab("est-torchtitan-8b", r"CPU's kernels.*\(trace/formula ([\d.]+)\)"),
    "bench-model.ours-ops": lambda: _grab("bench-model", r"as CUDA runs it\s+(\d+)"),
    "bench-model.gpt2-ops": lambda: _grab("bench-model", r"\(yardstick\)\s+(\d+)"),
    "bench-model.ours-mib": lambda: _grab("bench-model", r"as CUDA runs it\s+\d+\s+[\d.]+\s+([\d.]+)") + " MiB",
    "bench-model.gpt2-mib": lambda: _grab("bench-model", r"\(yardstick\)\s+\d+\s+[\d.]+\s+([\d.]+)") + " MiB",
    # the bench's targets against where the block stands ("targets: ops <= 1.5x, bytes <= 1.4x ...; here 1.47x and 1.65x")
    "bench-model.ops-vs-target": lambda: _bench_target(0),
    "bench-model.bytes-vs-target": lambda: _bench_target(1),
    "bench-model.ours-casts": lambda: _grab("bench-model", r"as CUDA runs it.*?([\d.]+) MiB$") + " MiB",
    "dry-1b.allocator-over": lambda: f"{100 * (_num(_grab('est-dry-run-1b', r'allocator: peak ([0-9.]+) GiB')) / _est('est-dry-run-1b', 'peak (', 4) - 1):.0f}%",
    "hooks.powersgd-less": lambda: f"1/{round(_num(_cell('table-04-hooks', 'powersgd', 'vs none')))}",
    "hooks.powersgd-gap": lambda: f"{_num(_cell('table-04-hooks', 'powersgd', 'final loss')) - _num(_cell('table-04-hooks', 'none', 'final loss')):.3f}",
    "trace-pp.cpu-activations-gap": lambda: f"{100 * (_est('est-trace-pp', 'activations', 2) / float(_grab('est-trace-pp', r'the formula with them: activations ([0-9.]+)')) - 1):.0f}%",
    "trace-pp.cpu-ratio": lambda: _grab("est-trace-pp", r"CPU's kernels.*\(trace/formula ([\d.]+)\)"),
    "table-03b.1f1b-activations": lambda: f"{max(_range(_cell('table-03b', 'PP 4, 1F1B', 'activations / rank (peak)'))):.2f} MiB",
    "table-03b.1f1b-peak": lambda: f"{max(_range(_cell('table-03b', 'PP 4, 1F1B', 'peak / rank'))):.2f} MiB",
    # step 3b: tensor, sequence and pipeline parallelism against one device, DDP and FSDP (table-03b)
    "03b.tp.sent": lambda: _t3b("TP 4", "sent per step / rank (logical)", "{:.1f} MiB"),
    "03b.tp.wire": lambda: _t3b("TP 4", "on the wire / rank", "{:.1f} MiB"),
    "03b.tp.params": lambda: _t3b("TP 4", "parameters / rank", "{:.1f}"),
    "03b.tp.grads": lambda: _t3b("TP 4", "gradients / rank", "{:.1f}"),
    "03b.tp.adamw": lambda: _t3b("TP 4", "AdamW state / rank", "{:.1f} MiB"),
    "03b.tp.act": lambda: _t3b("TP 4", "activations / rank (peak)", "{:.1f} MiB"),
    "03b.sp.sent": lambda: _t3b("TP 4 + sequence parallel", "sent per step / rank (logical)", "{:.2f}"),
    "03b.sp.wire": lambda: _t3b("TP 4 + sequence parallel", "on the wire / rank", "{:.2f} MiB"),
    "03b.sp.act": lambda: _t3b("TP 4 + sequence parallel", "activations / rank (peak)", "{:.1f} MiB"),
    "03b.sp.act-drop": lambda: "{:.0f} %".format(100 * (_t3b_num("TP 4 + sequence parallel", "activations / rank (peak)")
                                                      / _t3b_num("TP 4", "activations / rank (peak)") - 1)),
    "03b.sp.act-share": lambda: "{:.2f}".format(_t3b_num("TP 4 + sequence parallel", "activations / rank (peak)")
                                                / _t3b_num("one device", "activations / rank (peak)")),
    "03b.one.params": lambda: _t3b("one device", "parameters / rank", "{:.1f}"),
    "03b.one.grads": lambda: _t3b("one device", "gradients / rank", "{:.1f}"),
    "03b.one.adamw": lambda: _t3b("one device", "AdamW state / rank", "{:.1f} MiB"),
    "03b.one.act": lambda: _t3b("one device", "activations / rank (peak)", "{:.1f} MiB"),
    "03b.one.act-n": lambda: _t3b("one device", "activations / rank (peak)", "{:.1f}"),
    "03b.ddp.sent": lambda: _t3b("DDP 4", "sent per step / rank (logical)", "{:.1f} MiB"),
    "03b.ddp.wire": lambda: _t3b("DDP 4", "on the wire / rank", "{:.1f} MiB"),
    "03b.fsdp.sent": lambda: _t3b("FSDP 4 (train_fsdp.py)", "sent per step / rank (logical)", "{:.0f} MiB"),
    "03b.fsdp.wire": lambda: _t3b("FSDP 4 (train_fsdp.py)", "on the wire / rank", "{:.1f} MiB"),
    "03b.fsdp.adamw": lambda: _t3b("FSDP 4 (train_fsdp.py)", "AdamW state / rank", "{:.1f} MiB"),
    "03b.2d.adamw": lambda: _t3b("2-D: FSDP 2 x TP 2", "AdamW state / rank", "{:.1f} MiB"),
    "03b.gpipe.act": lambda: "{:.1f}-{:.1f} MiB".format(*_range(_cell("table-03b", "PP 4, GPipe", "activations / rank (peak)"))),
    "03b.1f1b.act-first": lambda: "{:.1f} MiB".format(max(_range(_cell("table-03b", "PP 4, 1F1B", "activations / rank (peak)")))),
    "03b.1f1b.act-last": lambda: "{:.1f} MiB".format(min(_range(_cell("table-03b", "PP 4, 1F1B", "activations / rank (peak)")))),
    "03b.interleaved.act": lambda: "{:.1f}-{:.1f} MiB".format(
        *_range(_cell("table-03b", "PP 4, interleaved", "activations / rank (peak)"))),
    # DeepSpeed's ZeRO beside ours (table-03-deepspeed)
    "ds.ds1.adamw": lambda: _ds("DeepSpeed ZeRO-1", "optimizer state"),
    "ds.ours1.adamw": lambda: _ds("ours: DDP + ZeRO-1", "optimizer state"),
    "ds.ds1.peak": lambda: _ds("DeepSpeed ZeRO-1", "peak (rank 0)", unit=False),
    "ds.ds2.peak": lambda: _ds("DeepSpeed ZeRO-2", "peak (rank 0)", unit=False),
    "ds.ours1.peak": lambda: _ds("ours: DDP + ZeRO-1", "peak (rank 0)", unit=False),
    "ds.ours2.peak": lambda: _ds("ours: FSDP2 ZeRO-2", "peak (rank 0)"),
    "ds.ds3.peak": lambda: _ds("DeepSpeed ZeRO-3", "peak (rank 0)", unit=False),
    "ds.ours3.peak": lambda: _ds("ours: FSDP2 ZeRO-3", "peak (rank 0)"),
    "ds.ds1.sent": lambda: _ds("DeepSpeed ZeRO-1", "sent per step (rank 0)", unit=False),
    "ds.ours1.sent": lambda: _ds("ours: DDP + ZeRO-1", "sent per step (rank 0)"),
    "ds.ours2.sent": lambda: _ds("ours: FSDP2 ZeRO-2", "sent per step (rank 0)"),
    "ds.ours3.sent": lambda: _ds("ours: FSDP2 ZeRO-3", "sent per step (rank 0)", unit=False),
    "ds.ds3.sent": lambda: _ds("DeepSpeed ZeRO-3", "sent per step (rank 0)"),
    # the dry runs
    "dry-1b.root-grads": lambda: _gib(_est(_DRY[0], "at peak: root's full gradients")),
    "dry-1b.root-copy": lambda: _gib(_est(_DRY[0], "at peak: root's fp32 reduce-scatter copy")),
    "dry-8b.formula-peak": lambda: _gib(_est(_DRY[1], "peak (")),
    "dry-8b.peak": lambda: _gib(_est(_DRY[1], "peak (", 2)),
    # torchtitan's layout on our code, saver by saver (fit-torchtitan-8b's last row)
    "tt-layout.selective": lambda: _gib(_tt_peak(3)),
    "tt-layout.selective-op": lambda: _gib(_tt_peak(5)),
    "tt-layout.selective-op-round": lambda: _gib(_tt_peak(5), 0),
    # the default 4 GiB of headroom against that peak: what the allocator may reserve beyond it
    "tt-layout.headroom-share": lambda: "{:.0%}".format(
        _num(_grab("est-torchtitan-8b", r"less ([\d.]+) GiB headroom")) / _tt_peak(3)),
    # that peak at the reserved/allocated ratio of the one GPU run of the layout (the H200's
    # dry run, figs/h200_2026-11-26/dry8b.log), and what it leaves of the usable memory
    "tt-layout.reserved-at-h200": lambda: _gib(_tt_peak(3) * _reserve_ratio()),
    "tt-layout.left-at-h200": lambda: _gib(_usable("est-torchtitan-8b") - _tt_peak(3) * _reserve_ratio()),
    # the same ratio on the trace's peak (FakeTensorMode, the CPU's kernels), and how far it lands over
    "tt-layout.trace-peak": lambda: _gib(_tt_trace_peak()),
    "tt-layout.trace-reserved-at-h200": lambda: _gib(_tt_trace_peak() * _reserve_ratio()),
    "tt-layout.trace-over-at-h200": lambda: _gib(_tt_trace_peak() * _reserve_ratio()
                                                 - _usable("est-torchtitan-8b")),
    # the planner's choices, and torchtitan's runs against its predictions
    "plan-1node.peak": lambda: f"{_num(_plan_row('plan-8b-1node', 1)[2]):.0f} GiB",
    "plan-1node.op-saves": lambda: f"{_num(_plan_row('plan-8b-1node', 1)[2]) - _num(_plan_row('plan-8b-1node', 2)[2]):.0f} GiB",
    "plan-4nodes.fsdp-comm": lambda: f"{_fsdp_comm_ms('plan-8b-4nodes'):.0f} ms",
    # where context parallelism ranks in the two plans (plan-8b-cp), and how far behind the first
    "plan-cp.1node-place": lambda: _ordinal(_cell("plan-8b-cp", "`plan-8b-1node`", "its place")),
    "plan-cp.4nodes-place": lambda: _ordinal(_cell("plan-8b-cp", "`plan-8b-4nodes`", "its place")),
    "plan-cp.behind": lambda: "-".join(sorted((f"{round((_num(_cell('plan-8b-cp', f'`{p}`', 'CP / fastest')) - 1) * 100)}"
                                               for p in ("plan-8b-1node", "plan-8b-4nodes")), key=int)) + "%",
    "tt.reserved-eager": lambda: f"{_num(_tt(_TT8, 'GiB theirs (reserved)')):.1f} GiB",
    "tt.peak-eager": lambda: f"{_num(_tt(_TT8, 'ours (peak)')):.1f} GiB",
    "tt.eager-8": lambda: _tt(_TT8, "ours/theirs"),
    "tt.eager-128": lambda: _tt(_TT128, "ours/theirs"),
    "tt.eager-fast": lambda: f"{round((_num(_tt(_TT8, 'ours/theirs')) - 1) * 100)}-{round((_num(_tt(_TT128, 'ours/theirs')) - 1) * 100)}%",
    "tt.compiled": lambda: f"{_tt(_TT8C, 'ours/theirs')}-{_tt(_TT128C, 'ours/theirs')}x",
    "tt.recompute-eager": lambda: _grab("plan-torchtitan", r"\| Table 1: FSDP, eager \|.*recompute ([\d,]*\d)") + " ms",
    "tt.memory-8": lambda: _pct_under(_cell("plan-torchtitan", _TT8, 9)),
    "tt.memory-128": lambda: _pct_under(_cell("plan-torchtitan", _TT128, 9)),
    "tt.cp-under": lambda: _range_pct([_pct_under(_cell("plan-torchtitan", f"Table 2: FSDP {8 // cp}, CP {cp}", 9))
                                       for cp in (1, 2, 4, 8)]),
    "tt.peak-eager-reserved": lambda: f"{_num(_tt(_TT8, 'ours (peak)')) * _dry8b('reserved') / _dry8b('allocated'):.1f} GiB",
    "tt.cp8-theirs": lambda: _tt("Table 2: FSDP 1, CP 8", "tokens/s/GPU theirs"),
    "tt.cp8-ours": lambda: _tt("Table 2: FSDP 1, CP 8", "ours"),
    "tt.compile-gain": lambda: f"{_num(_tt(_TT8C, 'tokens/s/GPU theirs')) / _num(_tt(_TT8, 'tokens/s/GPU theirs')):.2f}x",
    "achieved.compile-gain": lambda: (lambda a: f"{a['compiled'] / a['eager']:.2f}x")(
        __import__("common.measure.machines", fromlist=["ACHIEVED"]).ACHIEVED),
    "gpu.1b-compile-step-gain": lambda: f"{_gpu_run('1b_amp')['step_time_s'] / _gpu_run('1b_amp_compile')['step_time_s']:.2f}x",
    "tt.tp-ratio": lambda: _tt(_TP, "ours/theirs") + "x",
    "tt.tp-ours": lambda: _tt(_TP, "ours"),
    "tt.tp-theirs": lambda: _tt(_TP, "tokens/s/GPU theirs"),
    "tt.tp-old": lambda: _tt_tp_old(),
    "tt.tp-old-over": lambda: "{:.0%}".format(_num(_tt_tp_old()) / _num(_tt(_TP, "tokens/s/GPU theirs")) - 1),
    "tt.tp-comm": lambda: _grab("plan-torchtitan", r"\| asyncTP.*exposed communication ([\d,]*\d)") + " ms",
    "tt.tp-step": lambda: "{:,.0f} ms".format(sum(_num(t) for t in re.findall(r"[a-z] ([\d,]+)", _tt(_TP, "where our step goes (ms)")))),
    "tt.tp-peak": lambda: f"{_num(_tt(_TP, 'ours (peak)')):.1f} GiB",
    # the step-time model's achieved fractions, and the H200 report's MFU they came from
    "achieved.eager": lambda: _achieved("eager"),
    "achieved.compiled": lambda: _achieved("compiled"),
    "achieved.fp32": lambda: _achieved("fp32 eager"),
    "gpu.mfu-1b-amp": lambda: f"{_gpu_run('1b_amp')['mfu']:.1%}",
    "gpu.mfu-1b-compile": lambda: f"{_gpu_run('1b_amp_compile')['mfu']:.1%}",
    "gpu.mfu-1b-fp32": lambda: f"{_gpu_run('1b_fp32')['mfu']:.1%}",
}


GiB = 2**30


def _gap(run: str) -> int:
    """What the GPU's allocator held beyond the trace in the H200 report's row ``run``, in bytes."""
    r = _gpu_run(run)
    return r["allocator_peak_bytes"] - r["traced_peak_bytes"]


def _n_1b() -> int:
    from common.model import count_params, get_config
    return count_params(get_config("1b"))


def _tt_tp_old() -> str:
    """tokens/s a GPU the planner predicts for the asyncTP row at the settings it once assumed."""
    from tools.plan import torchtitan_rows, torchtitan_tp_as_first_assumed
    (row,) = [r for r in torchtitan_rows() if "TP 8" in r["what"]]
    return f"{torchtitan_tp_as_first_assumed(row['plan'].cfg)['tokens_per_s_per_gpu']:,.0f}"


def _reserve_ratio() -> float:
    """Reserved over allocated in the one GPU run of the 8b layout (the H200's dry run)."""
    return _dry8b("reserved") / _dry8b("allocated")


def _tt_trace_peak() -> float:
    """est-torchtitan-8b's traced peak (GiB): the peak row's second number."""
    return _num(_grab("est-torchtitan-8b", r"peak \([^)]*\)\s+[\d.]+\s+([\d.]+)"))


def _f8_act(row: str) -> float:
    """table-02-float8's measured activations at their own peak (MiB) of ``row``."""
    return _num(_cell("table-02-float8", row, "activations at their own peak (predicted for bf16)"))


def _f8_predicted() -> float:
    return _num(_cell("table-02-float8", "float8 + bf16", "activations at their own peak (predicted for bf16)"
                      ).split("(")[1])


def _range_pct(cells: list[str]) -> str:
    """['17%', '33%', '33%', '34%'] -> '17-34%' (one value alone: '17%')."""
    xs = sorted({int(_num(c)) for c in cells})
    return f"{xs[0]}%" if len(xs) == 1 else f"{xs[0]}-{xs[-1]}%"


# table-02's rows, by a short name
_S2 = {"base": "fp32 baseline", "amp": "AMP bf16", "sac": "AMP + selective AC", "ac": "AMP + full AC",
       "accum": "fp32, 4 micro-batches", "all": "AMP + full AC + 4 micro-batches"}


def _s2_num(run: str, column: str) -> float:
    """table-02's number for ``run`` (a key of _S2); ``column`` is the start of the header
    ('peak' for 'peak (MiB)'), the first header that starts so."""
    header = next(line for line in _text("table-02").splitlines() if line.startswith("| run |"))
    names = [c.strip() for c in header.strip().strip("|").split("|")]
    i = next(i for i, n in enumerate(names) if n == column or n.startswith(column + " ("))
    for line in _text("table-02").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] == _S2[run] or cells[0].startswith(_S2[run] + " ("):
            return _num(cells[i])
    raise LookupError(f"the block table-02 has no row {_S2[run]!r}")


def _s2(run: str, column: str, fmt: str) -> str:
    return fmt.format(_s2_num(run, column))


def _t3b_num(row: str, column: str) -> float:
    """table-03b's number (the first of a range over the ranks)."""
    return _range(_cell("table-03b", row, column))[0]


def _t3b(row: str, column: str, fmt: str) -> str:
    return fmt.format(_t3b_num(row, column))


def _ds(row: str, column: str, unit: bool = True) -> str:
    """table-03-deepspeed's cell ('18.8 MiB'; the number alone where the prose gives the unit once)."""
    cell = _cell("table-03-deepspeed", row, column).strip("*")
    return cell if unit else f"{_num(cell):.1f}"


def _zero1_wire() -> float:
    w = int(_grab("table-03a", r"W = (\d+) ranks"))
    broadcast = _num(_grab("table-03a", r"\| ZeRO-1 .*?\| AR [\d.]+ MiB \+ B ([\d.]+) MiB"))
    return _num(_cell("table-03a", "DDP", "a ring sends")) + broadcast * (w - 1) / w


def _tt_peak(column: int) -> float:
    """fit-torchtitan-8b's peak row, column 1, 3 or 5: the formula for the layout alone, with the
    chunked loss and the head's own unit, and with the per-op policy too."""
    return _num(_cell("fit-torchtitan-8b", "**peak**", column))


def _fsdp_comm_ms(name: str) -> float:
    """The first layout's all-gathers and reduce-scatters in a planner block, in ms a step."""
    first = _text(name).split("what each costs", 1)[1].split("\n2. ", 1)[0]
    return sum(float(ms) for ms in re.findall(r"(?:all_gather|reduce_scatter) over .*?: ([\d.]+) ms", first))



# ---- the plan-bench run, table-05, bench-ckpt, the chaos soak, the GPU report's trace gaps, test times
def _bench_target(i: int) -> str:
    """bench-model's ops (0) or bytes (1) against their target: 'within' or 'over'."""
    m = re.search(r"targets: ops <= ([\d.]+)x, bytes <= ([\d.]+)x the yardstick's; here ([\d.]+)x and ([\d.]+)x",
                  _text("bench-model"))
    if m is None:
        raise LookupError("the block bench-model no longer prints its targets")
    target, got = float(m.group(1 + i)), float(m.group(3 + i))
    return "within" if got <= target else "over"


def _kib(size: str) -> float:
    """'64 KiB' -> 64, '2 MiB' -> 2048."""
    return _num(size) * {"KiB": 1, "MiB": 1024, "GiB": 1024 ** 2}[size.split()[-1]]


def _rows(name: str) -> list[dict[str, str]]:
    """Every row of the markdown table in block ``name``, as {header: cell}."""
    lines = [[c.strip() for c in line.strip().strip("|").split("|")]
             for line in _text(name).splitlines() if line.startswith("|")]
    return [dict(zip(lines[0], cells)) for cells in lines[2:]]


def _span(values, fmt: str = "{:.2f}", unit: str = "") -> str:
    """'0.95-1.17' (the least and the most of ``values``), or the one value where they agree."""
    lo, hi = fmt.format(min(values)), fmt.format(max(values))
    return (lo if lo == hi else f"{lo}-{hi}") + unit


def _pb(layout: str | None = None, ranks: int | None = None, tp: bool | None = None) -> list[dict[str, str]]:
    """plan-bench's rows: of one layout (its first cell starts so), at one rank count, with or
    without tensor parallelism (tp or 2-D)."""
    return [r for r in _rows("plan-bench")
            if (layout is None or r["layout"].startswith(layout)) and (ranks is None or int(r["ranks"]) == ranks)
            and (tp is None or r["layout"].startswith(("tp", "2d")) == tp)]


def _pb_one(layout: str, ranks: int, column: str) -> float:
    (row,) = _pb(layout, ranks)
    return _num(row[column])


def _pb_ratios(rows: list[dict[str, str]]) -> str:
    return _span([_num(r["measured / predicted"]) for r in rows])


_PB_RATE = "block GFLOP/s at its shape (tp, sequences)"


def _pb_rates(split: bool) -> str:
    """The calibrated block's GFLOP/s over the rows whose shape is split by TP (tp > 1) or not."""
    return _span([_num(r[_PB_RATE]) for r in _rows("plan-bench")
                  if (int(re.search(r"tp=(\d+)", r[_PB_RATE]).group(1)) > 1) == split], "{:.0f}")


def _pb_zero1_extra() -> str:
    """What ZeRO-1's broadcast adds to DDP's exposed communication, at each rank count."""
    counts = sorted({int(r["ranks"]) for r in _pb("zero1")})
    return _span([_pb_one("zero1", n, "exposed communication") - _pb_one("ddp", n, "exposed communication")
                  for n in counts], "{:.0f}", " ms")


def _chaos_repeats() -> list[int]:
    """The chaos soak's kills that resumed at one step, the largest such group."""
    groups: dict[str, list[int]] = {}
    for r in _rows("chaos-soak"):
        groups.setdefault(r["resumed at step"], []).append(int(r["kill"]))
    best = max(groups.values(), key=len)
    if len(best) < 2:
        raise LookupError("the block chaos-soak has no two kills that resumed at the same step")
    return best


def _chaos_after_last() -> dict[str, str]:
    return next(r for r in _rows("chaos-soak") if r["during"] == "after the last checkpoint")


# the runs of the one-GPU check that held their own memory only (step 1, step 2 without
# checkpointing, DDP, ZeRO-1): how far their traced peak is under the allocator's
_OWN_MEMORY_RUNS = ("01_baseline", "02_amp", "02_amp_compile", "1b_fp32", "1b_amp", "03_ddp", "03_zero1")


def _tolerance(name: str):
    """A module-level constant of tests/tolerances.py, read from its source (the tools do not
    import the tests): the tolerances the parity tests assert with and the pages quote."""
    import ast
    for node in ast.parse((ROOT / "tests" / "tolerances.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise LookupError(f"tests/tolerances.py no longer defines {name}")


def _sci(x: float) -> str:
    """1e-05 -> '1e-5', as the pages write it."""
    return re.sub(r"e([+-])0*(\d)", lambda m: f"e{'-' if m.group(1) == '-' else ''}{m.group(2)}", f"{x:.0e}")


_WORDS = {2: "two", 3: "three", 4: "four", 5: "five"}


def _test_seconds(path: str) -> str:
    """The README's test-times table: a test file's seconds in the last full run."""
    return f"{_num(_cell('test-times', path, 'seconds')):.1f} s"


VALUES.update({
    # will_it_fit.md: the step-time model against the real scripts (plan-bench)
    "plan-bench.within": lambda: _grab("plan-bench", r"within 25%: (\d+ of \d+)"),
    "plan-bench.spearman": lambda: _grab("plan-bench", r"Spearman rank correlation of the orders: (-?[\d.]+)"),
    "plan-bench.4rank-ratios": lambda: _pb_ratios(_pb(ranks=4)),
    "plan-bench.fsdp4-ratio": lambda: _pb_ratios(_pb("fsdp", 4)),
    "plan-bench.pp4-bubble": lambda: f"{_pb_one('pp', 4, 'bubble'):.0f} ms",
    "plan-bench.pp4-predicted": lambda: f"{_pb_one('pp', 4, 'predicted ms'):,.0f} ms",
    "plan-bench.pp4-measured": lambda: f"{_pb_one('pp', 4, 'measured ms'):,.0f} ms",
    "plan-bench.tp-ratios": lambda: _pb_ratios(_pb(tp=True)),
    "plan-bench.tp4-ratios": lambda: _pb_ratios(_pb(ranks=4, tp=True)),
    "plan-bench.split-gflops": lambda: _pb_rates(split=True),
    "plan-bench.full-gflops": lambda: _pb_rates(split=False),
    "plan-bench.dtensor-ms": lambda: _span([float(x) for x in re.findall(r"DTensor ([\d.]+) ms a block",
                                                                          _text("plan-bench"))], "{:.1f}", " ms"),
    "plan-bench.zero1-extra": _pb_zero1_extra,
    "plan-bench.zero1-ratios": lambda: _pb_ratios(_pb("zero1")),
    "plan-bench.zero1-4-ratio": lambda: _pb_ratios(_pb("zero1", 4)),
    "plan-bench.after-before": lambda: _span([float(x) for x in re.findall(r"after/before ([\d.]+)",
                                                                           _text("plan-bench"))]),
    # step 4: the checkpoint's bytes over 12N (table-05), the async copy (bench-ckpt), the chaos soak
    "table-05.over-12n": lambda: _span([(float(x) - 1) * 100 for x in re.findall(r"\(([\d.]+)x\)", _text("table-05"))],
                                       "{:.0f}", "%"),
    "table-05.12n": lambda: f"{_num(_cell('table-05', 'ddp', '12N (4N weights + 8N AdamW)')):.1f} MiB",
    "bench-ckpt.host-copy": lambda: _grab("bench-ckpt", r"the host copy held ([\d.]+ GiB)"),
    "chaos.repeat-kills": lambda: (lambda k: f"{k[0]}-{k[-1]}" if k == list(range(k[0], k[-1] + 1)) and len(k) > 2
                                   else ", ".join(map(str, k[:-1])) + f" and {k[-1]}")(_chaos_repeats()),
    "chaos.last-kill": lambda: _chaos_after_last()["kill"],
    "chaos.last-resume": lambda: _chaos_after_last()["resumed at step"],
    # the one-GPU check: the traced peak under the allocator's, for the runs that held their own memory only
    "gpu.trace-under-allocator": lambda: _span([(1 - _gpu_run(n)["traced_peak_bytes"] / _gpu_run(n)["allocator_peak_bytes"])
                                                * 100 for n in _OWN_MEMORY_RUNS], "{:.1f}", "%"),
    # the comm lab: the hand-written ring against gloo's all-reduce (table-04-ring)
    # gloo's reduce-scatter against its all-reduce of the same input, time per call: 0.5 x the
    # bus bandwidths' ratio (factors 1.5 and 0.75), from 256 KiB up (3 decimals say little below)
    "coll.rs-vs-ar": lambda: _span([0.5 * _num(r["all_reduce"]) / _num(r["reduce_scatter"])
                                    for r in _rows("table-04-collectives") if _kib(r["size"]) >= 256]),
    "ring.ratios": lambda: (lambda r: f"{min(r):.2f} to {max(r):.2f}")(
        [_num(row["ring / library"]) for row in _rows("table-04-ring")]),
    "ring.largest-ratio": lambda: f"{_num(_rows('table-04-ring')[-1]['ring / library']):.2f}",
    # the tolerances the tests assert with (tests/tolerances.py)
    "test.parity-rtol": lambda: _sci(_tolerance("PARITY_RTOL")),
    "test.tight-rtol": lambda: _sci(_tolerance("TIGHT_RTOL")),
    "test.weight-in": lambda: f"{round(1 / _tolerance('WEIGHT_FRACTION')):,}",
    "test.weight-atol": lambda: _sci(_tolerance("WEIGHT_ATOL")),
    "test.allocator": lambda: f"{_tolerance('ALLOCATOR_RTOL'):.0%}",
    "test.bf16-gaps": lambda: _WORDS[_tolerance("BF16_GAPS")],
    "test.dry-other": lambda: f"{_tolerance('DRY_OTHER_FEWER'):.0%}",
    # the README's test-times table: a test file's time in the last full run
    "test-times.ep": lambda: _test_seconds("tests/test_ep.py"),
    "test-times.model-parallel": lambda: _test_seconds("tests/test_model_parallel.py"),
})

def fill(text: str) -> str:
    """``text`` with every <!-- v:NAME --> value rendered from its source now."""
    def one(m: re.Match) -> str:
        name = m.group(1)
        if name not in VALUES:
            raise KeyError(f"<!-- v:{name} --> names no value in tools/docs.py's VALUES")
        return f"<!-- v:{name} -->{VALUES[name]()}<!-- /v -->"
    return VALUE.sub(one, text)


def fill_pages() -> list[Path]:
    """Render every page's values from their sources (after the blocks are written); the pages
    that changed."""
    changed = []
    for p in doc_paths():
        text = p.read_text()
        new = fill(text)
        if new != text:
            p.write_text(new)
            changed.append(p)
    return changed


def stale() -> list[str]:
    """'page: NAME reads X, its source says Y' for each value that differs from its source."""
    out = []
    for p in doc_paths():
        for m in VALUE.finditer(p.read_text()):
            name, written = m.group(1), m.group(2)
            now = VALUES[name]() if name in VALUES else "(no such value)"
            if written != now:
                out.append(f"{p.relative_to(ROOT)}: {name} reads {written!r}, its source says {now!r}")
    return out


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(prog="python -m tools.docs", description=(
        "Render the numbers the pages quote (<!-- v:NAME --> ... <!-- /v -->) from their sources: the pages' "
        "blocks, figs/, train.slurm. python -m tools.figures does it after writing its blocks."))
    ap.add_argument("--check", action="store_true", help="write nothing; list the values that differ, exit 1 if any")
    a = ap.parse_args()
    if a.check:
        print("\n".join(stale()) or "every value is its source's")
        sys.exit(1 if stale() else 0)
    print("\n".join(f"rewrote the values of {p.relative_to(ROOT)}" for p in fill_pages()) or "no value changed")
