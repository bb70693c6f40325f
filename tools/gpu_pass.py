"""Everything that waits for a GPU, as one command that fits a lent machine's one call.

    python -m tools.gpu_pass --list                            # the streams, their commands, the targets
    python -m tools.gpu_pass --report-dir OUT                  # on a lent GPU: the whole pass, 570 s
    python -m tools.gpu_pass --rehearse --report-dir OUT       # the same streams on this CPU, tiny models
    python -m tools.gpu_pass --merge OUT                       # here, afterwards: figs/gpu_pass_<gpu>.md

A developer is lent a GPU rarely, for one command of at most 10 minutes, and at most 8
files come back from it. Run one after another the pass's commands take over half an hour;
side by side on the one GPU they fit. So the pass runs in two phases, each a set of
*streams* (a stream: commands run one after another, each its own fresh process, each
from its stream's own copy of the tree, its output kept):

1. the timings, alone on the GPU: the throughput benchmarks (125m and 1b), the GPT-2
   yardstick (eager and compiled), the speed variants at 125m (tools/bench_variants.py:
   compile per block or whole, fused AdamW, each attention kernel, CUDA graphs,
   max-autotune) and float8 against bf16 at 1b, one after another, within a share of the
   budget (TIMINGS_SHARE);
   nothing else runs beside a number that is a time;
2. the memory streams, side by side: gpu_check's runs in three streams (each in its own
   copy of the tree: gpu_check writes runs/ and figs/ under its tree; a gpu_check launch
   runs its runs in one worker process of its own, see CHECK_STREAMS), the saved-tensor
   census, the 8b dry run at torchtitan's layout, generation, the checkpoint benchmark and
   the test suite on the cores the others leave. A command starts when the GPU memory it
   is expected to hold (its ``gib``, the allocator's peak measured on an H200, rounded up)
   fits beside what the running ones hold, so that side by side no stream runs another
   out of memory.

A command that runs past its phase's end is stopped (SIGINT first, so that pytest still
names its failures, then SIGKILL to everything it started) and reported as stopped, with
the end of its output; the commands after it are reported as not run. The end of the
budget is kept for the last steps: gpu_check's reports are joined (``gpu_check --merge``),
the files are packed and the report written. What comes back, in ``--report-dir``:

- ``gpu_pass.md`` and ``gpu_pass.json``: the GPU, torch, the date and the git commit; per
  phase, stream and command: exit status, seconds, the end of its output, the targets it
  is held to;
- ``gpu_check_<gpu>.md`` and ``.json``: gpu_check's reports of the three streams, joined;
- ``figs.tar.gz``: the figures the commands wrote under their trees' figs/ (figs/), the
  rest they wrote there (trees/<stream>/figs/: gpu_check's part reports) and every
  command's output (logs/, its last MiB).

The lent machine reaches no package registry. A wheel it lacks travels in ``.carry/``
(ignored by git; ``pip download torchao==0.18.0 --no-deps -d .carry`` here, then name
``.carry`` among the paths the call carries): the pass unpacks each wheel whose packages
do not import there and puts it on its commands' PYTHONPATH (``unpack_carried``; the
report lists what it did). Without torchao the float8 row fails and says so; the rest runs.

``--rehearse`` runs the same streams on the CPU (no GPU is used, even where one is
visible), each command with its smallest settings (gpu_check's toy scale, the debug
model, a tiny dry run instead of the 8b one, one test file instead of the suite; the 1b
commands, which have no toy scale, left out), and writes the same files: the test suite
runs it (about two minutes on two cores), so the pass cannot rot between lends.

``--merge`` (here, no GPU needed) joins passes' report folders: it unpacks their figures
into figs/, joins gpu_check's part reports into ``figs/gpu_check_<gpu>.md`` (``gpu_check
--merge``, which also records where they were made), writes ``figs/gpu_pass_<gpu>.md``
(a later pass's stream replaces an earlier one's), and sets the step-time model's
prediction of one rank's step (common/measure/steptime.py, on the GPU's spec sheet) beside
gpu_check's measured steps at 125m and 1b, eager and compiled.

The targets printed beside each stream are the issues' own; this driver measures, it does
not judge: a number that misses stays in the report with its reason.
"""
from __future__ import annotations

import argparse
import datetime
import io
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MAX_FILES = 8            # what a lent machine sends back from one call ...
MAX_FILE_BYTES = 16 * 2**20  # ... each at most this big
LOG_BYTES = 2**20        # of each command's output, the end the tarball keeps
DEFAULT_BUDGET_S = 570   # a call is at most 600 s: the rest is the machine's own start and transfer
TIMINGS_SHARE = 0.35     # phase 1's share of the budget
RESERVE_S = 25           # the budget's end: join gpu_check's reports, pack the files, write the report
MIN_START_S = 5          # a command is not started with less than this left
GRACE_S = 10             # between SIGINT and SIGKILL when a command is stopped
HEADROOM_GIB = 4         # what the gate keeps back: each process's CUDA context, fragmentation
TAIL_CHARS = 6000        # of each command's output, in gpu_pass.json (the tarball keeps LOG_BYTES)
PARTS = "figs/gpu_check_parts"  # where, in its tree, each gpu_check launch writes its report
CARRY = ROOT / ".carry"  # wheels the lent machine lacks (it reaches no registry): carried with the tree
NOT_UNPACKED = {"test", "tests", "benchmarks"}  # a wheel's own test folders: they would shadow the stdlib's
GEN_RUN = "runs/gpu_pass/generate"


def unpack_carried(into: Path, env: dict, carry: Path = CARRY) -> list[str]:
    """Every wheel in ``carry`` whose packages this Python cannot import, unpacked into
    ``into`` and put first on ``env``'s PYTHONPATH, for the streams' processes; the wheels'
    names, each with what was done. The lent machine reaches no registry, so pip cannot
    install there; a wheel is a zip whose top-level folders import as they are (torchao's
    float8 is Python over torch's own float8 matmul; torchao tries to load its compiled
    extras and only warns where they do not fit this torch). A wheel's own test folders
    (torchao ships a top-level ``test`` package) are left out: first on the path, they would
    shadow the standard library's."""
    import importlib.util
    import zipfile
    done = []
    for wheel in sorted(carry.glob("*.whl")) if carry.is_dir() else []:
        with zipfile.ZipFile(wheel) as z:
            tops = sorted({n.split("/", 1)[0] for n in z.namelist() if "/" in n} - {""} - NOT_UNPACKED)
            packages = [t for t in tops if not t.endswith((".dist-info", ".data"))]
            if packages and all(importlib.util.find_spec(t) is not None for t in packages):
                done.append(f"{wheel.name}: already importable here, not unpacked")
                continue
            z.extractall(into, [n for n in z.namelist() if n.split("/", 1)[0] in tops])
        done.append(f"{wheel.name}: unpacked ({', '.join(packages)})")
    if any(d.endswith(")") for d in done):
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(into), env.get("PYTHONPATH")]))
    return done


@dataclass
class Command:
    argv: list[str]      # python's arguments, run from the top of the stream's tree
    gib: float = 0.0     # GPU memory it may hold at once, rounded up (measured, or the estimator's): the gate's


@dataclass
class Stream:
    name: str
    phase: int           # 1: alone on the GPU, one stream after another; 2: side by side
    targets: str         # what the numbers are held to (the issues' words)
    commands: list[Command] = field(default_factory=list)


# gpu_check's runs in three streams, each a sequence of launches (--only takes name prefixes),
# with the most GPU memory any of a launch's runs held on the H200 (figs/gpu_check_h200.json),
# rounded up (03_missed, not run there yet: the estimator's peaks are under 1 GiB). --only cannot
# pick one run alone (02_amp is a prefix of every 02_amp_* run), so a launch runs its runs one
# after another in one worker process: that is gpu_check's own design; a run that starts with an earlier one's bytes still allocated fails its row there.
CHECK_STREAMS = {
    "check_a": [("01,02", 14)],
    "check_b": [("1b", 42), ("03_dry,03_missed", 6)],
    "check_c": [("03_ddp,03_zero1,03_fsdp,03_tp,03_pp,03_2d,03_3d,03_cp,03_ep", 26)],
}


def check_groups(rehearse: bool) -> list[tuple[str, str, float]]:
    """(stream, --only, GiB) of every gpu_check launch; rehearsed, only the launches with
    toy runs (gpu_check --cpu refuses prefixes that name none: the 1b runs have no toy scale)."""
    from tools.gpu_check import CHECKS
    out = []
    for stream, groups in CHECK_STREAMS.items():
        for prefixes, gib in groups:
            if not rehearse or any(c.toy and c.name.startswith(tuple(prefixes.split(","))) for c in CHECKS):
                out.append((stream, prefixes, gib))
    return out


def suite_argv(spare_cores: int) -> list[str]:
    """gpu_check's test-suite command, its workers on the cores the other streams leave."""
    from tools.gpu_check import suite_command
    argv = suite_command()[1:]
    if "-n" in argv:
        argv[argv.index("-n") + 1] = str(max(1, spare_cores))
    return argv


def streams(rehearse: bool = False, big_memory: bool = False, cores: int | None = None) -> list[Stream]:
    """The pass's streams, in order, with each command chosen for the mode: on a GPU, or
    rehearsed on the CPU at the smallest settings. ``big_memory``: a GPU with over 100 GiB
    (the 8b dry run then takes torchtitan's local batch 2). ``cores``: the machine's."""
    gpu = not rehearse
    local = 2 if big_memory else 1
    cpu = ["--device", "cpu"]
    out = [
        Stream("throughput", 1, "overhead against the bare loop at most 2%; 0 host syncs a steady step; on an H100 "
               "125m at least 460k tokens/s and 1b at least 55% MFU (an H200: the same ratios, reported)",
               [Command(["-m", "tools.bench_throughput", "--device", "cuda"]),
                Command(["-m", "tools.bench_throughput", "--device", "cuda", "--scale", "1b"])] if gpu else
               # (1b has no toy scale: rehearsed, its commands are left out, here as in gpu_check's streams)
               [Command(["-m", "tools.bench_throughput", "--scale", "debug", "--steps", "1", *cpu])]),
        Stream("model", 1, "our eager 125m step at most 1.15x the GPT-2 yardstick's eager step; compiled too",
               [Command(["-m", "tools.bench_model"])] if gpu else
               [Command(["-m", "tools.bench_model", "--model", "debug", "--batch", "2", "--seq-len", "32"])]),
        # last in phase 1: what the phase's end cuts short, it cuts here (each row is printed as
        # it is measured); the order is what a default would most likely change for
        Stream("variants", 1, "the fastest of whole-model vs per-block compile, fused AdamW, each attention kernel, "
               "CUDA graphs and max-autotune at 125m, against step 3's per-block --compile: the default where it wins; "
               "float8 at 1b at least 1.25x the same whole-model graph in bf16",
               [Command(["-m", "tools.bench_variants", "--device", "cuda", "--timeout", "120", "--only",
                         "blocks,model,fused,cudnn,cudagraphs,efficient,flash,autotune,eager"]),
                # float8 where it can gain (1b), against the same graph in bf16: needs torchao, which
                # the lent machine lacks unless its wheel is carried in .carry/ (unpack_carried)
                Command(["-m", "tools.bench_variants", "--device", "cuda", "--scale", "1b", "--timeout", "150",
                         "--only", "model,float8"])] if gpu else
               # compiling on a CPU takes minutes: the rehearsal runs the one variant that compiles nothing
               [Command(["-m", "tools.bench_variants", "--scale", "debug", "--steps", "1", "--only", "eager",
                         *cpu])]),
    ]
    checks = check_groups(rehearse)
    what = {"check_a": "steps 1 and 2 at 125m, eager and compiled",
            "check_b": "the 1b runs, each step-3 script's dry run of 4 ranks with every collective's tensors "
                       "on the GPU, and the layouts the memory formula once missed (allocator within 3% of it)",
            "check_c": "every step-3 script at one rank (fp32: step 1's losses) and as a GPU user trains it (bf16, "
                       "full AC, compiled)"}
    for name in CHECK_STREAMS:
        # --fresh-process on a GPU: every script in a process of its own, so no run's peak holds
        # another's (the rehearsal, timed by the suite, shares one: tests/test_memory.py proves a
        # shared process leaves nothing of a finished run alive)
        cmds = [Command(["-m", "tools.gpu_check", *(["--cpu"] if rehearse else ["--fresh-process"]), "--no-tests",
                         "--only", prefixes,
                         "--report-dir", f"{PARTS}/{name}-{k}"], 0 if rehearse else gib)
                for k, (_, prefixes, gib) in enumerate([g for g in checks if g[0] == name], 1)]
        out.append(Stream(name, 2, f"gpu_check: {what[name]}: the allocator's peak beside the tracer's (within 1%), "
                          "the CUDA memory figures; --merge sets the step-time model's one-rank prediction beside "
                          "the 125m and 1b steps: within 10%", cmds))
    dry8b = ["-m", "tools.estimate", "--model", "8b", "--vocab-size", "128256", "--world-size", "8",
             "--strategy", "fsdp", "--batch", str(8 * local), "--seq-len", "8192", "--ac", "selective",
             "--dtype", "bf16", "--device", "cuda", "--dry-run"]
    savers = ["--loss-chunks", "16", "--split-root-unit", "--expandable-segments"]
    out += [
        Stream("census", 2, "the estimator's 1b rows within 3% of the allocator (gpu_check's 1b runs); each list is "
               "the CUDA formula's per-layer count to the byte (formulas.layer_activation_bytes, device cuda)",
               [Command(["-m", "tools.saved_census", "--model", "1b", "--device", "cuda", "--amp", amp, "--batch", "4",
                         "--seq-len", "2048"], 6) for amp in ("bf16", "off")] if gpu else
               [Command(["-m", "tools.saved_census", "--model", "debug", "--amp", amp, "--batch", "2", "--seq-len",
                         "32", *cpu]) for amp in ("bf16", "off")]),
        # the savers' run first: it is the one the targets name, and the smaller. Its GiB: the
        # estimator's peak for the layout (tools/estimate.py, no --dry-run), rounded up
        Stream("dry8b", 2, f"rank 0 of FSDP over 8, 8b at 128,256 vocabulary, local batch {local} x 8192, selective "
               "AC: measured peak and reserved beside the estimator and torchtitan's 82.4 GiB eager / 77.0 GiB "
               "compiled (local batch 2 on 96 GB H100s); with the savers (--loss-chunks 16 --split-root-unit "
               "--expandable-segments) reserved below 82.4 GiB and the allocator's peak within 3% of the formula; "
               "each difference explained",
               [Command(dry8b + savers, 70 if big_memory else 44), Command(dry8b, 92 if big_memory else 55),
                Command(["-m", "tools.estimate", "--model", "1b", "--vocab-size", "128256", "--world-size", "8",
                         "--strategy", "fsdp", "--batch", "8", "--seq-len", "2048", "--dtype", "bf16", "--device",
                         "cuda", "--dry-run"], 11)] if gpu else
               [Command(["-m", "tools.estimate", "--model", "debug", "--world-size", "4", "--strategy", "fsdp",
                         "--batch", "4", "--seq-len", "32", "--ac", "selective", "--loss-chunks", "2",
                         "--split-root-unit", "--dtype", "bf16", "--dry-run", *cpu])]),
        Stream("generate", 2, "bf16 generation runs on CUDA; greedy bf16 and fp32 continuations read alike; the KV "
               "cache's speed-up",
               [Command(["step1_single_gpu/train.py", "--model", "small", "--steps", "300", "--device", "cuda",
                         "--save-weights", "--no-trace-memory", "--eval-batches", "0", "--out", GEN_RUN], 4),
                *[Command(["-m", "tools.generate", GEN_RUN, "--prompt", "def ", "--device", "cuda", "--amp", amp,
                           "--temperature", "0", *extra], 2)
                  for amp, extra in (("bf16", []), ("off", []), ("bf16", ["--no-kv-cache"]))]] if gpu else
               [Command(["step1_single_gpu/train.py", "--model", "debug", "--steps", "2", "--data", "synthetic",
                         "--save-weights", "--no-trace-memory", "--eval-batches", "0", "--out", GEN_RUN, *cpu]),
                Command(["-m", "tools.generate", GEN_RUN, "--prompt", "def ", "--amp", "bf16", "--temperature", "0",
                         "--max-new-tokens", "8", *cpu])]),
        Stream("ckpt", 2, "a checkpoint step's stall, synchronous vs --ckpt-async, against a step without one",
               [Command(["-m", "tools.bench_ckpt", "--device", "cuda", "--out", "runs/gpu_pass/bench_ckpt"], 4),
                Command(["-m", "tools.bench_ckpt", "--device", "cuda", "--model", "1b", "--out",
                         "runs/gpu_pass/bench_ckpt_1b"], 24)] if gpu else
               [Command(["-m", "tools.bench_ckpt", "--model", "debug", "--steps", "4", "--ckpt-every", "2", "--out",
                         "runs/gpu_pass/bench_ckpt", *cpu])]),
    ]
    # the suite's tests train on CPU ranks: its workers take the cores the other streams leave
    others = sum(s.phase == 2 for s in out)
    out.append(Stream("tests", 2, "the suite passes with the GPU visible (every test names its device: --device "
                      "auto is an error under it)",
                      [Command(suite_argv((cores or os.cpu_count() or 1) - others), 2)] if gpu else
                      [Command(["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_data.py"])]))
    return out


# ---- running: each command its own process, stopped with everything it started ---------------
def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux's /proc), including those in sessions of their own:
    torchrun starts its workers so, and they would outlive a stopped launch holding the GPU."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _signal(group: int, pids: list[int], sig: int) -> None:
    for send, target in [(os.killpg, group), *[(os.kill, p) for p in pids]]:
        try:
            send(target, sig)
        except (ProcessLookupError, PermissionError):
            pass


def stop(proc: subprocess.Popen) -> None:
    """SIGINT (pytest then prints what failed so far; torchrun passes it on to its workers),
    and after GRACE_S SIGKILL to the process group and to every process found below it."""
    pids = _descendants(proc.pid)
    _signal(proc.pid, pids, signal.SIGINT)
    try:
        proc.wait(GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    _signal(proc.pid, pids + _descendants(proc.pid), signal.SIGKILL)
    proc.wait()


def _tail(log: Path, chars: int = TAIL_CHARS) -> str:
    """The end of a command's output; of a progress bar's redrawn line, its last drawing."""
    with open(log, "rb") as f:
        f.seek(max(0, log.stat().st_size - 8 * chars))
        text = f.read().decode(errors="replace")
    return "\n".join(line.rsplit("\r", 1)[-1] for line in text.split("\n"))[-chars:]


def run_command(cmd: Command, cwd: Path, env: dict, deadline: float, log: Path, why: str) -> dict:
    """Run ``cmd`` from ``cwd`` until it ends or ``deadline`` (time.monotonic) passes."""
    row = {"command": "python " + shlex.join(cmd.argv), "gib": cmd.gib}
    t0 = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, *cmd.argv], cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc, status = proc.wait(timeout=max(0.0, deadline - time.monotonic())), None
        except subprocess.TimeoutExpired:
            stop(proc)
            rc, status = None, "stopped"
    seconds = time.monotonic() - t0
    tail = _tail(log)
    if status:
        tail += f"\n[gpu_pass] stopped after {seconds:.0f} s: {why}"
    return {**row, "rc": rc, "status": status or ("ok" if rc == 0 else "failed"), "seconds": round(seconds, 1),
            "tail": tail}


class MemoryGate:
    """The GPU memory the side-by-side commands are expected to hold at once, kept within the
    GPU's. A command waits until its ``gib`` fits beside the running ones'; one larger than
    the whole GPU runs when nothing else holds any. ``capacity`` None: no gate (the CPU)."""

    def __init__(self, capacity: float | None):
        self.capacity, self.held = capacity, 0.0
        self.cond = threading.Condition()

    def acquire(self, gib: float, deadline: float) -> bool:
        if self.capacity is None or gib <= 0:
            return True
        with self.cond:
            while self.held > 0 and self.held + gib > self.capacity:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(left)
            self.held += gib
            return True

    def release(self, gib: float) -> None:
        if self.capacity is None or gib <= 0:
            return
        with self.cond:
            self.held -= gib
            self.cond.notify_all()


_print_lock = threading.Lock()


def say(line: str) -> None:
    """One line of progress: the side-by-side streams' lines never run into each other."""
    with _print_lock:
        print(line, flush=True)


def run_stream(stream: Stream, tree: Path, env: dict, deadline: float, logs: Path, gate: MemoryGate,
               why: str, t_start: float) -> dict:
    """``stream``'s commands one after another until ``deadline``; each row's ``at_s``: when it
    started, in seconds from ``t_start`` (the pass's start)."""
    rows, t0 = [], time.monotonic()
    for k, cmd in enumerate(stream.commands, 1):
        row = {"command": "python " + shlex.join(cmd.argv), "gib": cmd.gib, "rc": None, "status": "not run",
               "seconds": 0.0}
        if deadline - time.monotonic() < MIN_START_S:
            rows.append({**row, "tail": f"not run: {why}"})
            continue
        w0 = time.monotonic()
        if not gate.acquire(cmd.gib, deadline - MIN_START_S):
            rows.append({**row, "tail": f"not run: waited {time.monotonic() - w0:.0f} s for {cmd.gib:g} GiB of GPU "
                                        f"memory beside the other streams' commands, until {why}"})
            continue
        waited = round(time.monotonic() - w0, 1)
        say(f"[{stream.name}] $ {row['command']}")
        try:
            result = run_command(cmd, tree, env, deadline, logs / f"{stream.name}_{k}.log", why)
        finally:
            gate.release(cmd.gib)
        rows.append({**result, "waited_s": waited, "at_s": round(w0 + waited - t_start, 1)})
        say(f"[{stream.name}] {result['status']} (exit {result['rc']}, {result['seconds']} s)")
    states = {r["status"] for r in rows}
    state = next((s for s in ("stopped", "failed", "not run") if s in states), "ok")
    return {"name": stream.name, "phase": stream.phase, "targets": stream.targets, "state": state,
            "seconds": round(time.monotonic() - t0, 1), "commands": rows}


# ---- the machine, the trees, the files ----------------------------------------------------------
PROBE = ("import json, torch; p = torch.cuda.get_device_properties(0); "
         "print(json.dumps({'name': p.name, 'bytes': p.total_memory, 'torch': torch.__version__}))")


def probe_gpu() -> dict:
    """The GPU's name and memory, asked in a process of its own: this one never touches CUDA, so
    holds no context on the GPU the streams share."""
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    if r.returncode:
        raise RuntimeError(f"asking torch for the GPU failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def git_commit() -> str:
    try:
        r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                           timeout=30)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return r.stdout.strip() if r.returncode == 0 and r.stdout.strip() else "unknown"


def copy_tree(dest: Path) -> dict[Path, tuple[float, int]]:
    """The working tree into ``dest`` as a lent machine gets it: the files git tracks and the new
    ones it does not ignore (no runs/, .venv or .git; without git, the tree less those); and
    what its figs/ holds then, to tell what the commands wrote there."""
    try:
        r = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, timeout=60)
        names = [n for n in r.stdout.decode().split("\0") if n] if r.returncode == 0 else []
    except (OSError, subprocess.SubprocessError):
        names = []
    if names:
        for name in names:
            src = ROOT / name
            if src.is_file():  # (a tracked file deleted in the working tree is not)
                (dest / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dest / name, follow_symlinks=False)
    else:
        shutil.copytree(ROOT, dest, symlinks=True, ignore=shutil.ignore_patterns(
            "runs", ".venv", ".git", "__pycache__", ".pytest_cache"))
    (dest / "figs").mkdir(parents=True, exist_ok=True)
    return {p: (p.stat().st_mtime, p.stat().st_size) for p in (dest / "figs").rglob("*") if p.is_file()}


def written(tree: Path, before: dict) -> list[Path]:
    return sorted(p for p in (tree / "figs").rglob("*")
                  if p.is_file() and before.get(p) != (p.stat().st_mtime, p.stat().st_size))


def join_toy_reports(paths: list[Path], out_dir: Path) -> Path:
    """A rehearsal's gpu_check part reports, joined as gpu_check --merge joins a GPU's (every
    row, in CHECKS order) into ``out_dir``/gpu_check_cpu.json and .md. gpu_check --merge takes
    GPU reports only (toy rows beside GPU ones would mislead), so the rehearsal joins here."""
    from tools.gpu_check import CHECKS, markdown
    reports = [json.loads(p.read_text()) for p in paths]
    rows = {}
    for r in reports:
        rows.update({row["name"]: row for row in r["runs"]})
    order = [c.name for c in CHECKS]
    report = {**reports[-1], "runs": sorted(rows.values(), key=lambda r: order.index(r["name"]) if r["name"] in order
                                            else len(order)),
              "wall_s": sum(r.get("wall_s") or 0 for r in reports),
              "note": f"a rehearsal: {len(reports)} toy reports of tools/gpu_pass.py's streams, joined by it"}
    (out_dir / "gpu_check_cpu.json").write_text(json.dumps(report, indent=1) + "\n")
    (out_dir / "gpu_check_cpu.md").write_text(markdown(report))
    return out_dir / "gpu_check_cpu.json"


CONTENTION_NOTE = ("measured by python -m tools.gpu_pass: gpu_check's launches in three streams side by side with the "
                   "pass's other memory streams on the one GPU, so step times, tokens/s and MFU are under contention "
                   "(the throughput benchmark's, measured alone, are in figs/gpu_pass_<gpu>.md); each peak is its "
                   "own process's")


def run_pass(args, rehearse: bool) -> int:
    start = time.monotonic()
    out = Path(args.report_dir)
    if rehearse:
        from importlib.metadata import version
        info = {"name": "CPU (rehearsal: tiny models)", "bytes": None, "torch": version("torch")}
    else:
        info = probe_gpu()
    big = bool(info["bytes"]) and info["bytes"] > 100 * 2**30
    table = streams(rehearse, big)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu_pass_", dir=ROOT / "runs" if (ROOT / "runs").is_dir() else None))
    try:
        return _run_pass(args, rehearse, info, table, out, work, start)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run_pass(args, rehearse: bool, info: dict, table: list[Stream], out: Path, work: Path, start: float) -> int:
    budget = args.budget
    logs = work / "logs"
    logs.mkdir()
    print(f"gpu_pass{' --rehearse' if rehearse else ''}: {info['name']}, budget {budget:g} s; copying the tree for "
          f"{len(table)} streams into {work}", flush=True)
    trees = {s.name: (work / "trees" / s.name) for s in table}
    before = {name: copy_tree(tree) for name, tree in trees.items()}
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    carried = unpack_carried(work / "site", env)  # e.g. torchao's wheel, for the float8 variant
    for line in carried:
        say(f"carried: {line}")
    if rehearse:  # the CPU only, even where a GPU is visible; one thread a process: the streams share the cores
        env["CUDA_VISIBLE_DEVICES"] = ""
        env.setdefault("OMP_NUM_THREADS", "1")
    phase2 = [s for s in table if s.phase == 2]
    # the side-by-side streams share the cores too (the suite's conftest sets its own children's)
    env2 = dict(env, OMP_NUM_THREADS=env.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // len(phase2))))
    end1 = start + budget * TIMINGS_SHARE
    end2 = start + budget - RESERVE_S
    report = {"mode": "rehearse" if rehearse else "gpu", "device": info["name"],
              "gpu_memory_gib": round(info["bytes"] / 2**30, 1) if info["bytes"] else None, "torch": info["torch"],
              "date": datetime.date.today().isoformat(), "commit": git_commit(), "budget_s": budget,
              "command": "python -m tools.gpu_pass " + shlex.join(sys.argv[1:] if args.argv is None else args.argv),
              "carried": carried}
    results, no_gate = {}, MemoryGate(None)
    say(f"phase 1: the timings, alone, one after another (until {budget * TIMINGS_SHARE:.0f} s)")
    for s in table:
        if s.phase == 1:
            results[s.name] = run_stream(s, trees[s.name], env, end1, logs, no_gate,
                                         f"phase 1's share of the budget ({budget * TIMINGS_SHARE:.0f} s) was spent",
                                         start)
    t2 = time.monotonic()
    gate = MemoryGate(None if rehearse else info["bytes"] / 2**30 - HEADROOM_GIB)
    say(f"phase 2: {len(phase2)} streams side by side (until {budget - RESERVE_S:.0f} s)")

    def stream_thread(s: Stream) -> None:
        e = env if s.name == "tests" else env2
        try:
            results[s.name] = run_stream(s, trees[s.name], e, end2, logs, gate,
                                         f"phase 2's end ({budget - RESERVE_S:.0f} s into the budget) had come", start)
        except Exception as exc:  # the report still comes back, with the reason in it
            results[s.name] = {"name": s.name, "phase": 2, "targets": s.targets, "state": "failed", "seconds": 0.0,
                               "commands": [{"command": "(the stream)", "rc": None, "status": "failed",
                                             "seconds": 0.0, "tail": f"{type(exc).__name__}: {exc}"}]}

    threads = [threading.Thread(target=stream_thread, args=(s,), name=s.name) for s in phase2]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    report["phases"] = [
        {"phase": 1, "what": f"the timings, alone on the {'CPU' if rehearse else 'GPU'}, one after another",
         "until_s": round(budget * TIMINGS_SHARE), "seconds": round(t2 - start, 1),
         "streams": [results[s.name] for s in table if s.phase == 1]},
        {"phase": 2, "what": "the memory streams, side by side", "until_s": round(budget - RESERVE_S),
         "seconds": round(time.monotonic() - t2, 1), "streams": [results[s.name] for s in phase2]}]

    if args.keep_runs:  # (each gpu_check launch has runs of its own: their folders do not collide)
        for name in CHECK_STREAMS:
            for runs in sorted((trees[name] / "runs").glob("gpu_check_*")) if name in trees else []:
                shutil.copytree(runs, Path(args.keep_runs) / runs.name, dirs_exist_ok=True)
    # gpu_check's part reports, joined into one beside this report
    parts = sorted(p for name in CHECK_STREAMS if name in trees
                   for p in (trees[name] / PARTS).glob("*/gpu_check_*.json"))
    if not parts:
        report["gpu_check_merge"] = {"command": "-", "rc": None, "status": "not run", "seconds": 0.0,
                                     "tail": "no gpu_check launch wrote a report"}
    elif rehearse:
        t = time.monotonic()
        path = join_toy_reports(parts, out)
        report["gpu_check_merge"] = {"command": f"(joined by gpu_pass: {len(parts)} toy reports)", "rc": 0,
                                     "status": "ok", "seconds": round(time.monotonic() - t, 1), "tail": path.name}
    else:
        merged = work / "merged"
        cmd = Command(["-m", "tools.gpu_check", "--merge", *map(str, parts), "--report-dir", str(merged), "--note",
                       CONTENTION_NOTE])
        row = run_command(cmd, ROOT, env, start + budget - MIN_START_S, logs / "gpu_check_merge.log",
                          "the budget was spent")
        report["gpu_check_merge"] = {**row, "command": f"python -m tools.gpu_check --merge ({len(parts)} part reports)"}
        for f in merged.glob("gpu_check_*.*"):
            if f.suffix in (".json", ".md"):
                shutil.copyfile(f, out / f.name)

    # the tarball: the figures, the rest the commands wrote under figs/, every command's output
    tarball = out / "figs.tar.gz"
    packed = 0
    with tarfile.open(tarball, "w:gz") as tar:
        for name, tree in trees.items():
            for f in written(tree, before[name]):
                arc = f"figs/{f.name}" if f.suffix == ".png" else f"trees/{name}/{f.relative_to(tree).as_posix()}"
                tar.add(f, arcname=arc)
                packed += 1
        for f in sorted(logs.iterdir()):  # a chatty command's whole output could crowd out the figures
            size = f.stat().st_size
            with open(f, "rb") as log:
                log.seek(max(0, size - LOG_BYTES))
                data = (f"[gpu_pass: the first {size - LOG_BYTES:,} bytes left out]\n".encode()
                        if size > LOG_BYTES else b"") + log.read()
            info = tarfile.TarInfo(f"logs/{f.name}")
            info.size, info.mtime = len(data), int(time.time())
            tar.addfile(info, io.BytesIO(data))
    report["packed_files"] = packed
    report["wall_s"] = round(time.monotonic() - start, 1)
    (out / "gpu_pass.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "gpu_pass.md").write_text(markdown(report) + "\n")
    files = sorted(p.name for p in out.rglob("*"))
    if len(files) > MAX_FILES:  # a lent machine sends back no more: the rest would be lost
        raise RuntimeError(f"{out} holds {len(files)} files, more than the {MAX_FILES} a lent machine sends back: "
                           f"{', '.join(files)}")
    big = [f"{p.name} ({p.stat().st_size / 2**20:.1f} MiB)" for p in out.iterdir() if p.stat().st_size > MAX_FILE_BYTES]
    if big:
        raise RuntimeError(f"{', '.join(big)} is over the {MAX_FILE_BYTES / 2**20:.0f} MiB a lent machine sends back "
                           f"in one file")
    print(summary_markdown(report))
    bad = [f"{s['name']} ({s['state']})" for p in report["phases"] for s in p["streams"] if s["state"] != "ok"]
    if report["gpu_check_merge"]["status"] != "ok":
        bad.append(f"gpu_check's join ({report['gpu_check_merge']['status']})")
    print(f"wrote {', '.join(files)} to {out} in {report['wall_s']:.0f} s"
          + (f"; not all ran: {', '.join(bad)}" if bad else "; every command exited 0"), flush=True)
    return 1 if bad else 0


# ---- the report ---------------------------------------------------------------------------------
def summary_markdown(report: dict) -> str:
    out = ["| phase | stream | commands exited 0 | state | seconds |", "|---|---|---|---|---|"]
    for p in report["phases"]:
        for s in p["streams"]:
            ok = sum(c["rc"] == 0 for c in s["commands"])
            out.append(f"| {p['phase']} | {s['name']} | {ok} of {len(s['commands'])} | {s['state']} | {s['seconds']} |")
    return "\n".join(out)


def markdown(report: dict) -> str:
    passes = report.get("passes") or [report]
    out = [f"# GPU pass on {report['device']}", "",
           f"`{report.get('command', 'python -m tools.gpu_pass')}`: torch {report['torch']}, "
           + "; ".join(f"{p['date']}, commit {p.get('commit', 'unknown')}, {p.get('wall_s', 0):.0f} s of a "
                       f"{p.get('budget_s', 0):g} s budget" for p in passes) + ".", "",
           summary_markdown(report), ""]
    carried = [c for p in passes for c in p.get("carried") or []]
    if carried:
        out += ["Carried wheels: " + "; ".join(carried) + ".", ""]
    for p in report["phases"]:
        out += [f"## Phase {p['phase']}: {p['what']} (until {p['until_s']} s; took {p['seconds']} s)", ""]
        for s in p["streams"]:
            out += [f"### {s['name']}: {s['state']}, {s['seconds']} s", "", f"Held to: {s['targets']}", ""]
            for c in s["commands"]:
                when = f", from {c['at_s']:g} s into the pass" if "at_s" in c else ""
                waited = f" (after waiting {c['waited_s']:g} s for {c['gib']:g} GiB)" if c.get("waited_s") else ""
                out += [f"`{c['command']}`: {c['status']}, exit {c['rc']}, {c['seconds']} s{when}{waited}", "", "```",
                        c["tail"].rstrip()[-3000:], "```", ""]
    m = report.get("gpu_check_merge")
    if m:
        out += ["## gpu_check's reports, joined", "", f"`{m['command']}`: {m['status']}, exit {m['rc']}, "
                f"{m['seconds']} s", "", "```", m["tail"].rstrip()[-2000:], "```", ""]
    return "\n".join(out)


# gpu_check's one-rank runs whose step the step-time model predicts: (run, compiled)
ONE_RANK = [("01_baseline", False), ("02_amp", False), ("02_amp_compile_notrace", True), ("1b_fp32", False),
            ("1b_amp", False), ("1b_amp_compile", True)]


def predicted_vs_measured(check_report: dict) -> list[dict]:
    """gpu_check's measured step of each ONE_RANK run beside common/measure/steptime.py's
    prediction for the same model, batch and dtype on the spec sheet of the GPU that ran it."""
    from common.measure.machines import GPUS
    from common.measure.steptime import step_time
    from common.measure.plan import Plan
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
           "assumed there) beside gpu_check's mean step; target: within 10%. gpu_check ran "
           "beside the pass's other memory streams on the same GPU: a measured step here is at most the step "
           "alone (the throughput benchmark's, above, ran alone).", "",
           "| run | compiled | measured ms | predicted ms | of it compute | measured / predicted |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['name']} | - | - | - | - | {r['why']} |" if "why" in r else
                   f"| {r['name']} | {'yes' if r['compiled'] else 'no'} | {r['measured_ms']:,.1f} | "
                   f"{r['predicted_ms']:,.1f} | {r['compute_ms']:,.1f} | {r['ratio']:.2f} |")
    return "\n".join(out)


def merge(folders: list[str], out_dir: Path = ROOT / "figs") -> Path:
    """Join passes' report folders into ``out_dir``: their figures unpacked, gpu_check's part
    reports joined by gpu_check's own merge, and ``gpu_pass_<gpu>.md`` (a later pass's stream
    replaces an earlier one's) with one rank's predicted step beside gpu_check's measured one."""
    from tools import gpu_check
    out_dir = Path(out_dir)
    reports = []
    for f in folders:
        path = Path(f) / "gpu_pass.json"
        if not path.is_file():
            raise ValueError(f"no gpu_pass.json in {f} (give the folders --report-dir filled)")
        reports.append(json.loads(path.read_text()))
        if reports[-1].get("mode") != "gpu":
            raise ValueError(f"{f} holds a rehearsal's report (the CPU, tiny models): only GPU passes are merged "
                             f"into figs/")
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        parts = []
        for i, f in enumerate(folders):
            tarball = Path(f) / "figs.tar.gz"
            if not tarball.exists():
                continue
            with tarfile.open(tarball) as tar:
                for member in tar.getmembers():
                    name = PurePosixPath(member.name)
                    if not member.isfile() or ".." in name.parts or name.is_absolute():
                        continue  # nothing lands outside the folders meant for it
                    if name.parent == PurePosixPath("figs"):
                        (out_dir / name.name).write_bytes(tar.extractfile(member).read())
                    elif name.parts[0] == "trees" and PARTS.split("/")[1] in name.parts and name.suffix == ".json":
                        dest = Path(tmp, str(i), *name.parts[1:])
                        dest.parent.mkdir(parents=True, exist_ok=True)
                        dest.write_bytes(tar.extractfile(member).read())
                        parts.append(dest)
        if parts:  # in the passes' order, each pass's streams in turn: a later row of one name replaces an earlier
            gpu_check.merge([str(p) for p in parts], out_dir, note=CONTENTION_NOTE)
    done = {}
    for r in reports:
        done.update({s["name"]: s for p in r["phases"] for s in p["streams"]})
    order = [s.name for s in streams()]
    merged = {**reports[-1], "command": "python -m tools.gpu_pass --merge " + " ".join(["DIR"] * len(folders)),
              "passes": [{k: r.get(k) for k in ("date", "commit", "wall_s", "budget_s", "carried")} for r in reports]}
    rank = lambda s: order.index(s["name"]) if s["name"] in order else len(order)  # noqa: E731
    merged["phases"] = [{**p, "streams": sorted((s for s in done.values() if s["phase"] == p["phase"]), key=rank)}
                        for p in reports[-1]["phases"]]
    slug = gpu_check.gpu_slug(merged["device"])  # gpu_check's name for the same GPU: its report sits beside ours
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
    p.add_argument("--list", action="store_true", help="print the streams, their commands and targets; run nothing")
    p.add_argument("--rehearse", action="store_true",
                   help="the same streams on the CPU with tiny models (no GPU used), the same files written")
    p.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S,
                   help=f"seconds the whole pass may take (default: {DEFAULT_BUDGET_S}; phase 1 gets "
                        f"{TIMINGS_SHARE * 100:.0f}%% of it)")
    p.add_argument("--report-dir", help=f"an empty or new folder for the report's files (at most {MAX_FILES})")
    p.add_argument("--merge", nargs="+", metavar="DIR", help="join passes' report folders into figs/ (no GPU needed)")
    p.add_argument("--keep-runs", metavar="DIR", help="copy gpu_check's run folders (metrics, summaries, traces) out of "
                   "the streams' copies of the tree into DIR before they are removed (they are not among the files a "
                   "lent machine sends back)")
    args = p.parse_args(argv)
    args.argv = argv
    if not 60 <= args.budget <= 3600:  # (nan fails this too)
        print(f"error: --budget must be between 60 and 3600 seconds (got {args.budget:g})", file=sys.stderr)
        return 2
    if args.merge:
        try:
            print(f"wrote {merge(args.merge)}")
        except (ValueError, KeyError, json.JSONDecodeError, tarfile.TarError) as e:
            print(f"error: --merge: {e}", file=sys.stderr)
            return 2
        return 0
    rehearse = args.rehearse
    if not rehearse:
        import torch
        available = torch.cuda.is_available()
    if args.list:
        big = not rehearse and available and probe_gpu()["bytes"] > 100 * 2**30
        for s in streams(rehearse, big):
            print(f"phase {s.phase}, {s.name}: {s.targets}")
            for c in s.commands:
                print(f"    python {shlex.join(c.argv)}" + (f"    (~{c.gib:g} GiB)" if c.gib else ""))
        return 0
    if not rehearse and not available:
        print("error: no CUDA GPU is visible here; the GPU pass measures a GPU: run it on one, or pass --rehearse "
              "for the same streams on the CPU (--list shows what it would run)", file=sys.stderr)
        return 2
    if not args.report_dir:
        print(f"error: --report-dir is missing: name the empty or new folder the pass's files (at most {MAX_FILES}) "
              f"go to", file=sys.stderr)
        return 2
    out = Path(args.report_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        print(f"error: --report-dir {out} is not an empty folder: give a new one (the pass writes at most "
              f"{MAX_FILES} files, and no others may be mistaken for them)", file=sys.stderr)
        return 2
    try:
        return run_pass(args, rehearse)
    except RuntimeError as e:  # the GPU could not be asked for, or more files than come back
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
