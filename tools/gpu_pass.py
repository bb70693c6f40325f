"""Everything that waits for a GPU, in parts that fit a lent machine's calls.

    python -m tools.gpu_pass --list                          # the parts, their commands, minutes
    python -m tools.gpu_pass --budget 540 --report-dir OUT   # the parts that fit 9 minutes, in order
    python -m tools.gpu_pass --parts throughput,census --report-dir OUT
    python -m tools.gpu_pass --merge OUT1 OUT2 ...           # here, after the calls: one report

A developer with a lent GPU has a few calls of at most 10 minutes each and about 30
minutes in all, the machine's start included, and only a few files come back from each
call. So every measurement the project waits for is one *part* of this driver: a list of
the commands a learner would type (``python -m tools.bench_throughput --scale 1b``...),
each run as its own process with a time limit, its output kept. ``--budget`` runs the
parts not yet done, in order, while the next one's expected minutes still fit, and names
the ones left for the next call; a part that overruns is stopped at the budget, so the
call always ends in time to send its files back. Each call writes three files to
``--report-dir``: ``gpu_pass.md`` (per command: exit status, seconds, the end of its
output, the targets it is held to), ``gpu_pass.json`` (the same) and ``figs.tar.gz`` (the
files the commands wrote under figs/: the CUDA memory figures and gpu_check's report).
``--merge`` (here, no GPU needed) joins the reports of several calls into
``figs/gpu_pass_<gpu>.md``, unpacks their figures into figs/, and sets the step-time
model's prediction of one rank's step (tools/plan.py's model, on the GPU's spec sheet) beside
gpu_check's measured steps at 125m and 1b, eager and compiled.

The targets printed beside each part are the issues' own; this driver measures, it does
not judge: a number that misses stays in the report with its reason.
"""
from __future__ import annotations

import argparse
import datetime
import json
import shlex
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PY = [sys.executable]
GEN_RUN = "runs/gpu_pass/generate"


@dataclass
class Part:
    name: str
    minutes: float        # expected on one H100 (the budget's unit); a guess until measured
    commands: list        # argv lists, run from the repository's top folder, one after another
    targets: str          # what the numbers are held to (the words)


def parts(big_memory: bool = False) -> list[Part]:
    """The GPU pass, in the order it should run. ``big_memory``: a GPU with over 100 GiB (the 8b
    dry run then takes torchtitan's local batch 2)."""
    from tools.gpu_check import suite_command
    local = 2 if big_memory else 1
    return [
        Part("check_one", 6, [[*PY, "-m", "tools.gpu_check", "--no-tests", "--only", "01,02,1b"]],
             "steps 1 and 2 at 125m and 1b, eager and compiled: the allocator's peak beside the tracer's (within "
             "1%), the CUDA memory figures (figs/*_cuda_*.png, figs/gpu_check_<gpu>.md/.json); --merge sets the "
             "step-time model's one-rank prediction beside these steps: within 10% (issue 38 item 6)"),
        Part("throughput", 3, [
            [*PY, "-m", "tools.bench_throughput"],
            [*PY, "-m", "tools.bench_throughput", "--scale", "1b"]],
             "overhead against the bare loop at most 2%; 0 host syncs a steady step; on an H100 125m at least "
             "460k tokens/s and 1b at least 55% MFU (an H200: the same ratios, reported)"),
        Part("census", 2, [
            [*PY, "-m", "tools.saved_census", "--model", "1b", "--device", "cuda", "--amp", "bf16",
             "--batch", "4", "--seq-len", "2048"],
            [*PY, "-m", "tools.saved_census", "--model", "1b", "--device", "cuda", "--amp", "off",
             "--batch", "4", "--seq-len", "2048"]],
             "the estimator's 1b rows within 3% of the allocator (gpu_check's 1b runs); each list is the CUDA "
             "formula's per-layer count to the byte (theory.layer_activation_bytes, device cuda)"),
        Part("model", 2, [[*PY, "-m", "tools.bench_model"]],
             "our eager 125m step at most 1.15x the GPT-2 yardstick's eager step; compiled too"),
        Part("check_three", 6, [[*PY, "-m", "tools.gpu_check", "--no-tests", "--only", "03"]],
             "every step-3 script at one rank (fp32: step 1's losses) and as a GPU user trains it (bf16, full AC, "
             "compiled); each 4-rank layout's dry run with every collective's tensors on the GPU"),
        Part("dry8b", 4, [
            [*PY, "-m", "tools.estimate", "--model", "8b", "--vocab-size", "128256", "--world-size", "8",
             "--strategy", "fsdp", "--batch", str(8 * local), "--seq-len", "8192", "--ac", "selective",
             "--dtype", "bf16", "--device", "cuda", "--dry-run"],
            [*PY, "-m", "tools.estimate", "--model", "8b", "--vocab-size", "128256", "--world-size", "8",
             "--strategy", "fsdp", "--batch", str(8 * local), "--seq-len", "8192", "--ac", "selective",
             "--loss-chunks", "16", "--split-root-unit", "--expandable-segments", "--dtype", "bf16", "--device",
             "cuda", "--dry-run"],
            [*PY, "-m", "tools.estimate", "--model", "1b", "--vocab-size", "128256", "--world-size", "8",
             "--strategy", "fsdp", "--batch", "8", "--seq-len", "2048", "--dtype", "bf16", "--device", "cuda",
             "--dry-run"]],
             f"rank 0 of FSDP over 8, 8b at 128,256 vocabulary, local batch {local} x 8192, selective AC: measured "
             "peak and reserved beside the estimator and torchtitan's 82.4 GiB eager / 77.0 GiB compiled (local "
             "batch 2 on 96 GB H100s); with the savers (--loss-chunks 16 --split-root-unit --expandable-segments) "
             "reserved below 82.4 GiB and the allocator's peak within 3% of the formula; each difference explained"),
        Part("generate", 2, [
            [*PY, "step1_single_gpu/train.py", "--model", "small", "--steps", "300", "--device", "cuda",
             "--save-weights", "--no-trace-memory", "--eval-batches", "0", "--out", GEN_RUN],
            [*PY, "-m", "tools.generate", GEN_RUN, "--prompt", "def ", "--device", "cuda", "--amp", "bf16",
             "--temperature", "0"],
            [*PY, "-m", "tools.generate", GEN_RUN, "--prompt", "def ", "--device", "cuda", "--amp", "off",
             "--temperature", "0"],
            [*PY, "-m", "tools.generate", GEN_RUN, "--prompt", "def ", "--device", "cuda", "--amp", "bf16",
             "--temperature", "0", "--no-kv-cache"]],
             "bf16 generation runs on CUDA; greedy bf16 and fp32 continuations read alike; the KV cache's speed-up"),
        Part("ckpt", 3, [
            [*PY, "-m", "tools.bench_ckpt", "--device", "cuda", "--out", "runs/gpu_pass/bench_ckpt"],
            [*PY, "-m", "tools.bench_ckpt", "--device", "cuda", "--model", "1b", "--out",
             "runs/gpu_pass/bench_ckpt_1b"]],
             "a checkpoint step's stall, synchronous vs --ckpt-async, against a step without one"),
        Part("tests", 8, [suite_command()],
             "the suite passes with the GPU visible (every test names its device: --device auto is an error under it)"),
    ]


def fits(todo: list[Part], budget_min: float) -> tuple[list[Part], list[Part]]:
    """The parts of ``todo`` to run now (in order, while the next one's minutes fit what is
    left) and those left for another call. A part longer than the whole budget still runs
    when it comes first (its commands are stopped at the budget), so every call makes progress."""
    now, left, used = [], [], 0.0
    for p in todo:
        if not left and (used + p.minutes <= budget_min or not now):
            now.append(p)
            used += p.minutes
        else:
            left.append(p)
    return now, left


def run_part(part: Part, deadline: float) -> dict:
    rows = []
    for argv in part.commands:
        remaining = deadline - time.monotonic()
        row = {"command": shlex.join(argv[1:])}
        if remaining < 5:
            rows.append({**row, "rc": None, "seconds": 0.0, "tail": "not run: the call's budget was spent"})
            continue
        t0 = time.monotonic()
        print(f"$ python {row['command']}", flush=True)
        try:
            r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=remaining)
            rc, out = r.returncode, r.stdout + ("\n" + r.stderr if r.stderr.strip() else "")
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
            rc, out = None, out + f"\nstopped after {remaining:.0f} s: the call's budget"
        rows.append({**row, "rc": rc, "seconds": round(time.monotonic() - t0, 1), "tail": out[-6000:]})
        print(f"  exit {rc}, {rows[-1]['seconds']} s", flush=True)
    return {"name": part.name, "targets": part.targets, "commands": rows}


def markdown(report: dict) -> str:
    out = [f"# GPU pass on {report['device']}", "",
           f"torch {report['torch']}, {report['date']}; parts: {', '.join(p['name'] for p in report['parts'])}"
           + (f"; left for another call: {', '.join(report['left'])}" if report.get("left") else ""), ""]
    for p in report["parts"]:
        out += [f"## {p['name']}", "", f"Held to: {p['targets']}", ""]
        for c in p["commands"]:
            out += [f"`python {c['command']}`: exit {c['rc']}, {c['seconds']} s", "", "```",
                    c["tail"].rstrip()[-3000:], "```", ""]
    return "\n".join(out)


# gpu_check's one-rank runs whose step the step-time model predicts (issue 38 item 6): (run, compiled)
ONE_RANK = [("01_baseline", False), ("02_amp", False), ("02_amp_compile_notrace", True), ("1b_fp32", False),
            ("1b_amp", False), ("1b_amp_compile", True)]


def predicted_vs_measured(check_report: dict) -> list[dict]:
    """gpu_check's measured step of each ONE_RANK run beside common/measure/steptime.py's
    prediction for the same model, batch and dtype on the spec sheet of the GPU that ran it."""
    from common.measure.steptime import GPUS, step_time
    from common.measure.theory import Plan
    from common.model import get_config
    from tools.gpu_check import CHECKS, SCALES

    gpu = "h200" if "H200" in check_report["device"] else "h100"
    rows, runs = [], {r["name"]: r for r in check_report["runs"]}
    for name, compiled in ONE_RANK:
        run = runs.get(name)
        if not run or not run.get("ok"):
            rows.append({"name": name, "why": "did not run" if not run else run.get("error", "failed")})
            continue
        check = next(c for c in CHECKS if c.name == name)
        flags = SCALES[check.scale][0] + check.flags
        flag = lambda f, d: flags[flags.index(f) + 1] if f in flags else d  # noqa: E731
        plan = Plan(get_config(flag("--model", None)), "single", batch=int(flag("--global-batch-size", 0)),
                    seq_len=int(flag("--seq-len", 0)), dtype=run.get("dtype") or "fp32", ac=flag("--ac", "none"),
                    device="cuda")
        t = step_time(plan, GPUS[gpu], compiled)
        rows.append({"name": name, "gpu": gpu, "compiled": compiled, "measured_ms": run["step_time_s"] * 1e3,
                     "predicted_ms": t["step"] * 1e3, "compute_ms": t["compute"] * 1e3,
                     "ratio": run["step_time_s"] / t["step"]})
    return rows


def prediction_markdown(rows: list[dict]) -> str:
    out = ["## One rank: the step-time model against the measured step", "",
           "`common/measure/steptime.py` on the spec sheet (achieved fraction and compile factor as "
           "assumed there) beside gpu_check's mean step; target: within 10% (issue 38, item 6).", "",
           "| run | compiled | measured ms | predicted ms | of it compute | measured / predicted |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['name']} | - | - | - | - | {r['why']} |" if "why" in r else
                   f"| {r['name']} | {'yes' if r['compiled'] else 'no'} | {r['measured_ms']:,.1f} | "
                   f"{r['predicted_ms']:,.1f} | {r['compute_ms']:,.1f} | {r['ratio']:.2f} |")
    return "\n".join(out)


def merge(folders: list[str], out_dir: Path = ROOT / "figs") -> Path:
    """Join the calls' reports into ``out_dir``/gpu_pass_<gpu>.md, unpack their figures into
    ``out_dir``, and set one rank's predicted step beside gpu_check's measured one."""
    out_dir = Path(out_dir)
    for f in folders:
        tarball = Path(f) / "figs.tar.gz"
        if tarball.exists():
            with tarfile.open(tarball) as tar:
                for member in tar.getmembers():  # figs/<name> only: nothing lands outside out_dir
                    name = Path(member.name)
                    if member.isfile() and name.parent == Path("figs"):
                        data = tar.extractfile(member).read()
                        (out_dir / name.name).write_bytes(data)
    reports = [json.loads((Path(f) / "gpu_pass.json").read_text()) for f in folders]
    done = {}
    for r in reports:  # a later call's part replaces an earlier one of the same name
        done.update({p["name"]: p for p in r["parts"]})
    order = [p.name for p in parts()]
    merged = {**reports[-1], "parts": sorted(done.values(), key=lambda p: order.index(p["name"])),
              "left": [n for n in order if n not in done]}
    from tools.gpu_check import gpu_slug
    slug = gpu_slug(merged["device"])  # gpu_check's name for the same GPU: its report sits beside ours
    text = markdown(merged)
    check = out_dir / f"gpu_check_{slug}.json"
    if check.exists():
        text += "\n" + prediction_markdown(predicted_vs_measured(json.loads(check.read_text()))) + "\n"
    path = out_dir / f"gpu_pass_{slug}.md"
    path.write_text(text + "\n")
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.gpu_pass", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--list", action="store_true", help="print the parts and their commands, run nothing")
    p.add_argument("--parts", default=None, help="comma-separated part names (default: all, in order)")
    p.add_argument("--budget", type=float, default=540, help="seconds this call may take (default: 540)")
    p.add_argument("--report-dir", default="runs/gpu_pass/report", help="where the three files go")
    p.add_argument("--merge", nargs="+", metavar="DIR", help="join earlier calls' report folders into figs/")
    args = p.parse_args(argv)
    names = [x.name for x in parts()]
    chosen = args.parts.split(",") if args.parts else names
    unknown = [n for n in chosen if n not in names]
    if unknown:
        print(f"error: no part is called {unknown[0]!r}; the parts are {', '.join(names)}", file=sys.stderr)
        return 2
    if not 60 <= args.budget <= 3600:
        print(f"error: --budget must be between 60 and 3600 seconds (got {args.budget:g})", file=sys.stderr)
        return 2
    if args.merge:
        print(f"wrote {merge(args.merge)}")
        return 0
    import torch
    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    big = torch.cuda.is_available() and torch.cuda.get_device_properties(0).total_memory > 100 * 2**30
    todo = [x for x in parts(big) if x.name in chosen]
    if args.list:
        for x in todo:
            print(f"{x.name} (~{x.minutes:g} min): {x.targets}")
            for c in x.commands:
                print(f"    python {shlex.join(c[1:])}")
        return 0
    if not torch.cuda.is_available():
        print("error: no CUDA GPU is visible here; the GPU pass measures a GPU: run it on one (--list shows "
              "what it would run)", file=sys.stderr)
        return 2
    start = time.monotonic()
    deadline = start + args.budget - 20  # the last seconds: write the report, pack the figures
    now, left = fits(todo, args.budget / 60)
    print(f"this call: {', '.join(x.name for x in now)}" + (f"; left: {', '.join(x.name for x in left)}" if left else ""))
    figs_before = {f: f.stat().st_mtime for f in (ROOT / "figs").iterdir()}
    report = {"device": name, "torch": torch.__version__, "date": datetime.date.today().isoformat(),
              "parts": [run_part(x, deadline) for x in now], "left": [x.name for x in left]}
    report["wall_s"] = round(time.monotonic() - start, 1)
    out = Path(args.report_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_pass.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "gpu_pass.md").write_text(markdown(report) + "\n")
    written = [f for f in (ROOT / "figs").iterdir() if figs_before.get(f) != f.stat().st_mtime]
    with tarfile.open(out / "figs.tar.gz", "w:gz") as tar:
        for f in written:
            tar.add(f, arcname=f"figs/{f.name}")
    print(f"wrote {out}/gpu_pass.md, gpu_pass.json and figs.tar.gz ({len(written)} figure files)"
          + (f"; next call: --parts {','.join(report['left'])}" if left else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
