"""Random kills: a training job under ``torchrun --max-restarts`` must end where an
uninterrupted one ends, whatever dies and whenever.

    python -m tools.chaos --kills 3 --seed 0
    python -m tools.chaos --kills 10 --steps 200 --script step3_multi_gpu/train_fsdp.py
    python -m tools.chaos --reference runs/ref -- --max-norm 0.5    (flags for the script after --)

First the job runs once untouched (the reference; or give one with ``--reference DIR``,
the --out of a run with the same flags). Then it runs again under
``torchrun --max-restarts K ... --resume``, and this tool SIGKILLs a randomly chosen rank
(a worker process of torchrun, found in /proc: a child of torchrun whose environment says
its RANK) at random moments: each attempt trains a random number of steps (1 to two
checkpoint intervals), then the kill comes at once or at the next checkpoint write (a
``step_..._partial`` folder exists). The last kill may instead come once the last step's
checkpoint is complete, before the run has written its outputs (summary.json): the restart
then loads that checkpoint, trains nothing and writes them. (Other kills stop before the
last checkpoint begins: after it no step is left for them.) torchrun stops the other ranks
and starts them all again; ``--resume`` continues from the newest complete checkpoint. At
the end the losses of every step, the final checkpoint's weights and the summary's final
loss must equal the reference's, bit for bit (fp32 on CPU), and a table says what happened:

    kill  after  rank  during      resumed at  steps re-run
    ...

It exits 0 when the result matches, 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a file

from common.errors import UserError, main_guard  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# The smallest job that trains for real: 4 layers, batch 4 x 32 tokens, fp32 on CPU ranks.
FLAGS = ["--model", "debug", "--seq-len", "32", "--global-batch-size", "4", "--no-trace-memory", "--eval-batches",
         "0", "--device", "cpu", "--amp", "off", "--data", "synthetic"]


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--script", default="step3_multi_gpu/train_ddp.py", help="the training script (default: DDP)")
    p.add_argument("--nproc", type=int, default=2, help="ranks (default: 2)")
    p.add_argument("--kills", type=int, default=3, help="how many times a rank is killed (default: 3)")
    p.add_argument("--steps", type=int, default=40, help="training steps (default: 40)")
    p.add_argument("--ckpt-every", type=int, default=2, help="checkpoint every N steps (default: 2)")
    p.add_argument("--seed", type=int, default=0, help="seed of the kills' ranks and moments (default: 0)")
    p.add_argument("--reference", default=None, help="--out of an uninterrupted run with the same flags (default: run one)")
    p.add_argument("--out", default="runs/chaos", help="folder for the runs (default: runs/chaos)")
    p.add_argument("--timeout", type=float, default=300, help="seconds for the whole test (default: 300)")
    p.add_argument("--json", default=None, help="also write the table and verdict to this file")
    p.add_argument("flags", nargs="*", help="after --: more flags for the script (they win over the defaults)")
    a = p.parse_args(argv)
    if a.nproc < 1 or a.kills < 0 or a.steps < 2 or a.ckpt_every < 1:
        raise UserError(f"--nproc {a.nproc}, --kills {a.kills}, --steps {a.steps}, --ckpt-every {a.ckpt_every}: "
                        f"give at least 1 rank, 0 kills, 2 steps and a checkpoint every 1 step or more.")
    if not (ROOT / a.script).is_file():
        raise UserError(f"--script {a.script} is not a file of this repository.")
    if not 0 < a.timeout <= 86400:
        raise UserError(f"--timeout must be between 0 and 86400 seconds (got {a.timeout}).")
    return a


def _torchrun(a, out: Path, restarts: int, extra=()) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(a.nproc),
            "--max-restarts", str(restarts), "--monitor-interval", "0.1", a.script, *FLAGS, "--steps", str(a.steps),
            "--ckpt-every", str(a.ckpt_every), "--ckpt-keep", "2", *a.flags, *extra, "--out", str(out)]


def workers(launcher: int) -> dict[int, int]:
    """{rank: pid} of torchrun's live workers: its children that have a RANK."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            if int(stat.rsplit(")", 1)[1].split()[1]) != launcher or stat.rsplit(")", 1)[1].split()[0] == "Z":
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        if b"RANK" in env:
            found[int(env[b"RANK"])] = int(entry)
    return found


def logged_steps(out: Path) -> int:
    """The newest step in metrics.jsonl (-1: none yet)."""
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
        return max((json.loads(line)["step"] for line in lines if line.strip().endswith("}")), default=-1)
    except (OSError, ValueError):
        return -1


# What rank 0 prints as an attempt starts, with --resume: where it starts.
STARTS = re.compile(r"resumed from \S+ \(step (\d+),|--resume: no complete checkpoint")


def writing_checkpoint(out: Path, since: float) -> bool:
    """Whether a checkpoint is being written: a ``_partial`` folder made or written to since
    ``since`` (one left by a write that an earlier kill cut short is older)."""
    for p in (out / "checkpoints").glob("step_*_partial"):
        try:
            if p.stat().st_mtime >= since:
                return True
        except OSError:
            continue  # renamed meanwhile
    return False


def chaos(a) -> dict:
    out, rng = Path(a.out), random.Random(a.seed)
    deadline = time.monotonic() + a.timeout
    ref = Path(a.reference) if a.reference else out / "reference"
    run = out / "killed"
    shutil.rmtree(run, ignore_errors=True)
    t0 = time.monotonic()
    if not a.reference:
        shutil.rmtree(ref, ignore_errors=True)
        r = subprocess.run(_torchrun(a, ref, 0), cwd=ROOT, capture_output=True, text=True,
                           timeout=max(1, deadline - time.monotonic()))
        if r.returncode:
            raise UserError(f"the reference run failed: {(r.stderr.strip().splitlines() or ['?'])[-1][:300]}")
    ref_seconds = time.monotonic() - t0
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "killed.log", "w")
    t1 = time.monotonic()
    job = subprocess.Popen(_torchrun(a, run, a.kills, ["--resume"]), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                           start_new_session=True)
    kills, gone = [], set()  # the pids of the attempts already killed
    try:
        for i in range(a.kills):
            during = rng.choice(["step", "checkpoint"] + (["end"] if i == a.kills - 1 else []))
            rank = rng.randrange(a.nproc)
            # Attempt i has started: all its workers are up and rank 0 has said where it starts
            while time.monotonic() < deadline and job.poll() is None:
                live = workers(job.pid)
                if (len(live) == a.nproc and not gone & set(live.values())
                        and len(STARTS.findall((out / "killed.log").read_text())) > i):
                    began = time.time() - 1.0  # (file times have coarse clocks on some file systems)
                    break
                time.sleep(0.01)
            if job.poll() is not None or time.monotonic() >= deadline:
                break  # the run ended before every kill was used: the table says so
            # Let it train a random number of steps (1 to two checkpoints' worth), then a moment more
            step = STARTS.findall((out / "killed.log").read_text())[-1]
            until = (int(step) + 1 if step else 0) + rng.randint(1, 2 * a.ckpt_every)
            pause = rng.uniform(0.0, 0.05)
            if during == "end":  # the last checkpoint is complete and summary.json not yet written
                live, final = workers(job.pid), run / "checkpoints" / f"step_{a.steps - 1:08d}"
                writing = final.with_name(final.name + "_partial")
                while not (writing.exists() or final.exists()) and job.poll() is None and time.monotonic() < deadline:
                    time.sleep(0.005)
                while not (final / "meta.json").exists() and job.poll() is None and time.monotonic() < deadline:
                    pass  # being written: then a window of milliseconds before summary.json, so no sleep
                if rank not in live or job.poll() is not None:
                    break
                os.kill(live[rank], signal.SIGKILL)
                gone |= set(live.values())
                kills.append({"kill": i + 1, "after_s": round(time.monotonic() - t1, 2), "rank": rank,
                              "during": "after the outputs" if (run / "summary.json").exists() else
                              "after the last checkpoint", "last_logged": logged_steps(run)})
                break
            while logged_steps(run) < until and job.poll() is None and time.monotonic() < deadline:
                time.sleep(0.005)
            time.sleep(pause)
            if during == "checkpoint":  # the next checkpoint being written (rank 0 makes its folder, then all ranks write)
                while not writing_checkpoint(run, began) and job.poll() is None and time.monotonic() < deadline:
                    time.sleep(0.001)
            live = workers(job.pid)
            if rank not in live or logged_steps(run) >= a.steps - 1 - a.ckpt_every:
                break  # the last checkpoint may begin: no step is left for this kill
            mid_write = writing_checkpoint(run, began)
            at = logged_steps(run)
            os.kill(live[rank], signal.SIGKILL)
            gone |= set(live.values())
            kills.append({"kill": i + 1, "after_s": round(time.monotonic() - t1, 2), "rank": rank,
                          "during": "checkpoint write" if mid_write else "step", "last_logged": at})
        job.wait(timeout=max(1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
    finally:
        log.close()
    starts = STARTS.findall((out / "killed.log").read_text())  # one per attempt, in order
    resumed = [int(step) + 1 if step else 0 for step in starts[1:]]
    for k, first in zip(kills, resumed):
        k["resumed_at"] = first
        k["steps_rerun"] = max(0, k["last_logged"] + 1 - first)  # logged before the kill, trained again
    match, why = compare(ref, run, a.steps) if job.returncode == 0 else (False, f"the job failed ({job.returncode})")
    return {"kills": kills, "restarts": len(resumed), "returncode": job.returncode, "match": match, "why": why,
            "reference_s": round(ref_seconds, 1), "killed_run_s": round(time.monotonic() - t1, 1),
            "script": a.script, "nproc": a.nproc, "steps": a.steps, "seed": a.seed}


def compare(ref: Path, run: Path, steps: int) -> tuple[bool, str]:
    """Every step's loss and the last checkpoint's weights and AdamW state, bit for bit."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    def losses(folder):
        return {json.loads(line)["step"]: json.loads(line)["loss"] for line in
                (folder / "metrics.jsonl").read_text().splitlines() if line.strip()}

    a, b = losses(ref), losses(run)
    if sorted(b) != list(range(steps)):
        return False, f"the killed run logged steps {sorted(b)}"
    bad = [s for s in a if a[s] != b.get(s)]
    if bad:
        return False, f"losses differ from step {bad[0]}: {a[bad[0]]} vs {b.get(bad[0])}"
    last = f"step_{steps - 1:08d}"
    states = []
    for folder in (ref, run):
        dest = folder / f"{last}.pt"
        dest.unlink(missing_ok=True)
        dcp_to_torch_save(str(folder / "checkpoints" / last), str(dest))
        states.append(torch.load(dest, weights_only=False))
        dest.unlink()
    flat = [{k: v for part in ("model", "optim") for k, v in s[part].items() if isinstance(v, torch.Tensor)}
            for s in states]
    if flat[0].keys() != flat[1].keys() or not all(torch.equal(flat[0][k], flat[1][k]) for k in flat[0]):
        return False, "the final weights or AdamW state differ"
    if not (run / "summary.json").exists():
        return False, "the killed run wrote no summary.json"
    finals = [json.loads((folder / "summary.json").read_text())["final_loss"] for folder in (ref, run)]
    if finals[0] != finals[1]:
        return False, f"summary.json's final loss differs: {finals[0]} vs {finals[1]}"
    return True, (f"{steps} losses, {len(flat[0])} tensors of the final checkpoint and summary.json's final loss "
                  f"equal, bit for bit")


def table(res: dict) -> str:
    rows = ["| kill | after (s) | rank | during | resumed at step | steps re-run |", "|---|---|---|---|---|---|"]
    for k in res["kills"]:
        rows.append(f"| {k['kill']} | {k['after_s']:.1f} | {k['rank']} | {k['during']} | "
                    f"{k.get('resumed_at', '-')} | {k.get('steps_rerun', '-')} |")
    rerun = sum(k.get("steps_rerun", 0) for k in res["kills"])
    rows.append(f"\n{len(res['kills'])} kills, {res['restarts']} restarts, {rerun} steps re-run in all; "
                f"result: {'same' if res['match'] else 'DIFFERENT'} ({res['why']}). "
                f"{res['script']} on {res['nproc']} ranks, {res['steps']} steps, seed {res['seed']}; "
                f"the killed run took {res['killed_run_s']:.0f} s, the reference {res['reference_s']:.0f} s.")
    return "\n".join(rows)


@main_guard
def main(argv=None):
    a = parse(argv)
    res = chaos(a)
    print(table(res), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    sys.exit(0 if res["match"] else 1)


if __name__ == "__main__":
    main()
