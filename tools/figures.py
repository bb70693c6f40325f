"""Regenerate every figure in figs/ from real runs: ``python -m tools.figures``.

Each chapter lists the runs it needs (a script and its flags) and which of their outputs
become which figure. ``--only 01`` regenerates the figures whose names start with 01;
``--device cuda`` runs on a GPU (the figures then get a ``_cuda`` suffix so the CPU ones
stay). Runs go to runs/figs/<run name>/.

Runs that share a ``job`` are launched together: one torchrun job (tools/multirun.py)
calls their scripts one after another, because starting processes that import torch is
a good part of a short run's cost on a small machine. The jobs' output goes to
runs/figs/<job>.log; the terminal shows one progress bar over all the runs.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a file (python tools/x.py): find common/

# Each chapter's runs and tables live beside its scripts, in <chapter folder>/figures.py (the
# folders are imported as namespace packages from the repo root); what they share is in
# tools/figure_runs.py, which imports none of them.
import step1_single_gpu.figures as step1  # noqa: E402
import step2_memory.figures as step2  # noqa: E402
import step3_multi_gpu.figures as step3  # noqa: E402
import step4_multi_node.figures as step4  # noqa: E402
from common.errors import UserError  # noqa: E402
from tools.figure_runs import Run, run_dir, summary, this_device  # noqa: E402,F401 (re-exported)

from common import ROOT  # noqa: E402

# The chapters' runs, in the order they are launched (runs of one job run in this order)
CHAPTER1, CHAPTER2, FLOAT8, VOCAB = step1.CHAPTER1, step2.CHAPTER2, step2.FLOAT8, step2.VOCAB_RUNS
CHAPTER3A, CHAPTER3B, CHAPTER4 = step3.CHAPTER3A, step3.CHAPTER3B, step3.CHAPTER4
CHAPTER3_CP, CHAPTER3_EP, DRY_CP_EP = step3.CHAPTER3_CP, step3.CHAPTER3_EP, step3.DRY_CP_EP
CHAPTER5 = step4.CHAPTER5
FLOAT8_DS = FLOAT8 + step3.DEEPSPEED
RUNS = (CHAPTER1 + CHAPTER2 + VOCAB + CHAPTER3A + CHAPTER3B + CHAPTER4 + CHAPTER5 + FLOAT8_DS + CHAPTER3_CP + CHAPTER3_EP
        + list(DRY_CP_EP.values()))


def gpu_check_report(suffix: str = "") -> dict[str, str]:
    """The reports ``python -m tools.gpu_check`` left in figs/ (one per GPU model), for the
    README's GPU section; a sentence saying there is none yet otherwise."""
    if suffix:
        return {}
    reports = [p for p in sorted((ROOT / "figs").glob("gpu_check_*.md")) if p.stem != "gpu_check_cpu"]
    if not reports:
        return {"gpu-check": "No GPU report is in figs/ yet: `python -m tools.gpu_check` on a CUDA machine writes "
                             "one (figs/gpu_check_<gpu>.md), and this command copies it here."}
    parts = []
    for p in reports:
        slug = p.stem.removeprefix("gpu_check_")
        pngs = sorted((ROOT / "figs").glob(f"*_cuda_{slug}.png"))
        runs = {}  # the report's rows by run name: a figure NN_memory_trace_REST is run NN_REST's
        if p.with_suffix(".json").exists():
            runs = {r["name"]: r for r in json.loads(p.with_suffix(".json").read_text())["runs"]}
        rows = []
        for png in pngs:
            name = png.name.split("_cuda_")[0]
            run = runs.get(name.replace("_memory_trace_", "_", 1), {})
            ratio = (f"{run['traced_peak_bytes'] / run['allocator_peak_bytes']:.3f}"
                     if run.get("traced_peak_bytes") and run.get("allocator_peak_bytes") else "-")
            rows.append(f"| {name} | [CPU](figs/{name}.png) | [{slug.upper()}](figs/{png.name}) | {ratio} |")
        figs = (f"\n\nThe memory figures of these runs, beside the CPU ones the chapters show (the same kind of "
                f"figure; the GPU's runs are the report's, at its sizes and ranks), with the report's traced / "
                f"allocator ratio of the run: a ratio well below 1 is an allocator line that also holds what the "
                f"report's note says earlier runs left alive, not the run's own memory:\n\n"
                f"| figure | CPU | CUDA | traced / allocator |\n|---|---|---|---|\n" + "\n".join(rows)) if rows else ""
        parts.append(p.read_text().strip() + figs)
    return {"gpu-check": "\n\n".join(parts)}


# (prefix of what it writes in figs/, callable(suffix) -> {README marker: markdown}); each
# draws on the runs above and is redone when --only matches its prefix
POST_STEPS = [*step1.POST_STEPS, *step2.POST_STEPS, *step3.POST_STEPS, *step4.POST_STEPS,
              ("gpu", gpu_check_report)]


def update_readme(tables: dict[str, str]):
    """Replace the text between <!-- BEGIN name --> and <!-- END name --> markers, in
    whichever page of the walkthrough (tools/docs.py) holds them; then the numbers the prose
    quotes from them (tools/docs.py's VALUES), so no sentence keeps a block's old number."""
    from tools.docs import block, fill_pages, untimed
    for name, body in tables.items():
        found = block(name)
        if found is None:
            print(f"no page has a <!-- BEGIN {name} --> marker; table {name} not written", flush=True)
            continue
        if untimed(found[1]) == untimed(body):  # only the command's own time moved: the page stays as it is
            continue
        begin, end = f"<!-- BEGIN {name} -->", f"<!-- END {name} -->"
        head, rest = found[0].read_text().split(begin, 1)
        _, tail = rest.split(end, 1)
        found[0].write_text(f"{head}{begin}\n{body.strip(chr(10))}\n{end}{tail}")
    for path in fill_pages():
        print(f"{path.relative_to(ROOT)}: its numbers follow the blocks now", flush=True)


def jobs(todo: list[Run]) -> list[list[Run]]:
    """The runs grouped by job, in the order each job first appears."""
    grouped: dict[str, list[Run]] = {}
    for r in todo:
        grouped.setdefault(r.job, []).append(r)
        if r.nproc != grouped[r.job][0].nproc:
            raise ValueError(f"run {r.name} has {r.nproc} processes but its job {r.job} has "
                             f"{grouped[r.job][0].nproc}: give it a job of its own")
    return list(grouped.values())


def fit_on_gpus(todo: list[Run], gpus: int) -> list[Run]:
    """The runs this machine's GPUs can make (NCCL wants a GPU per rank); says which are left out."""
    left_out = [r.name for r in todo if r.nproc > gpus]
    if left_out:
        print(f"leaving out {len(left_out)} runs that need more GPUs than the {gpus} here: {', '.join(left_out)}",
              flush=True)
    return [r for r in todo if r.nproc <= gpus]


def argv(run: Run, suffix: str, device: str) -> list[str]:
    return [*run.flags, "--out", str(run_dir(run.name, suffix).relative_to(ROOT)), "--device", device]


def command(run: Run, suffix: str, device: str) -> str:
    """The command that makes this run by itself."""
    launcher = "python" if run.nproc == 1 else f"torchrun --standalone --nproc-per-node {run.nproc}"
    return " ".join([launcher, run.script, *argv(run, suffix, device)])


def launch(job: list[Run], suffix: str, device: str, bar) -> None:
    """One process (or one torchrun job) for all of ``job``'s runs; its output goes to
    runs/figs/<job>.log, and each ``[multirun] done`` line it prints moves ``bar`` on.
    Exits with the log's tail if the job fails."""
    from tqdm import tqdm
    first = job[0]
    cmd = [sys.executable] if first.nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={first.nproc}"]
    cmd += ["tools/multirun.py", "--runs", json.dumps([{"name": r.name, "script": r.script,
                                                         "argv": argv(r, suffix, device)} for r in job])]
    log = ROOT / "runs" / "figs" / f"{first.job}{suffix}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    for r in job:  # a figure's run starts afresh: an older run's checkpoints there would be refused as another run's
        shutil.rmtree(run_dir(r.name, suffix) / "checkpoints", ignore_errors=True)
    by_name = {r.name: r for r in job}
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(log, "w") as f, subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                               stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            f.write(line)
            if "[multirun] start " in line:
                name = line.split("[multirun] start ", 1)[1].strip()
                bar.set_postfix_str(name)
                tqdm.write("$ " + command(by_name[name], suffix, device))
                f.write("$ " + command(by_name[name], suffix, device) + "\n")
            elif "[multirun] done " in line:
                bar.update(1)
    if proc.returncode:
        bar.close()
        print("\n".join(log.read_text().splitlines()[-40:]), file=sys.stderr)
        sys.exit(f"error: the job {first.job} failed (exit code {proc.returncode}); its whole output is in "
                 f"{log.relative_to(ROOT)}")


def record_provenance(written: list[Path], device: str, argv: list[str], path: Path = ROOT / "figs" / "made_on.json",
                      tool: str = "python -m tools.figures", entry: dict | None = None):
    """Remember, per file in figs/, the device, torch version, date and command that made it:
    regenerating one chapter keeps the others' entries. ``entry``: those four, when the files
    were made on another machine (a GPU's reports, merged here)."""
    import datetime

    import torch
    made = json.loads(path.read_text()) if path.exists() else {}
    entry = entry or {"device": this_device(device), "torch": torch.__version__.split("+")[0],
                      "date": datetime.date.today().isoformat(),
                      "command": " ".join([tool, *argv])}
    made.update({p.name: entry for p in written})
    made = {k: v for k, v in sorted(made.items()) if (path.parent / k).exists()}
    path.write_text(json.dumps(made, indent=1) + "\n")
    return made


def provenance_table(made: dict[str, dict]) -> str:
    """Which device made which figures: one row per chapter prefix and machine."""
    rows: dict[tuple, list[str]] = {}
    for name, e in made.items():
        rows.setdefault((name.split("_", 1)[0], e["device"], e["torch"], e["date"], e["command"]), []).append(name)
    lines = ["| files in figs/ | made on | torch | date | by |", "|---|---|---|---|---|"]
    for (prefix, dev, torch_version, date, cmd), names in rows.items():
        folders = sum((ROOT / "figs" / n).is_dir() for n in names)
        counts = [(len(names) - folders, "file"), (folders, "folder")]
        files = ", ".join(f"{k} {what}{'s' if k != 1 else ''}" for k, what in counts if k)
        lines.append(f"| `{prefix}_*` ({files}) | {dev} | {torch_version} | {date} | `{cmd}` |")
    return "\n".join(lines)


def main(argv=None):
    from tqdm import tqdm
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="", help="regenerate only the figures whose names start with this")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = p.parse_args(argv)
    suffix = "" if args.device == "cpu" else "_cuda"
    # a run is redone if one of its figures, or its name (runs that only feed a table), matches --only
    todo = [r for r in RUNS if any(f.startswith(args.only) for f in r.figures) or (not r.figures and not args.only)
            or (args.only and r.name.startswith(args.only))]
    if not todo and not any(prefix.startswith(args.only) for prefix, _ in POST_STEPS):
        print(f"error: no figure or run name starts with {args.only!r}; figure names start with 01, 02, 03, 04 "
              f"or 05 (see figs/), --only estimates redoes the estimator's answers, --only misuse the troubleshooting table", file=sys.stderr)
        sys.exit(2)
    if args.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            print("error: --device cuda: this machine has no CUDA GPU (or this torch has no CUDA); leave "
                  "--device out to make the CPU figures", file=sys.stderr)
            sys.exit(2)
        todo = fit_on_gpus(todo, torch.cuda.device_count())
    start = time.time()
    bar = tqdm(total=len(todo), unit="run", desc="figures", dynamic_ncols=True)
    for job in jobs(todo):
        launch(job, suffix, args.device, bar)
        for run in job:
            for fig, src in run.figures.items():
                shutil.copyfile(run_dir(run.name, suffix) / src, ROOT / "figs" / fig.replace(".png", f"{suffix}.png"))
    bar.close()
    tables = {}
    for prefix, post in POST_STEPS:
        if not (prefix.startswith(args.only) or args.only.startswith(prefix)):
            continue
        try:
            tables.update(post(suffix) or {})
        except FileNotFoundError as e:  # --only skipped the runs this table needs
            print(f"skipped {post.__name__}: {e.filename} is missing", flush=True)
        except UserError as e:  # the same, said by tools/compare.py (a run folder missing)
            print(f"skipped {post.__name__}: {e}", flush=True)
    written = [f for f in sorted((ROOT / "figs").iterdir()) if f.stat().st_mtime >= start and f.name != "made_on.json"]
    made = record_provenance(written, args.device, sys.argv[1:] if argv is None else argv)
    tables["figs-made-on"] = provenance_table(made)
    update_readme(tables)
    print(f"wrote {len(written)} files in figs/ and {len(tables)} README tables in {time.time() - start:.0f} s; "
          f"the runs' output is in runs/figs/", flush=True)


if __name__ == "__main__":
    main()
