"""The faults chapter's figures and blocks (step4_multi_node/README.md), made by
``python -m tools.figures --only 05`` (and ``--only 05_resume``, ``05_bench_ckpt``,
``chaos``, ``misuse``): the checkpoint table (step4_multi_node/tables.py), the resumed
run's model against the uninterrupted one's, a checkpoint step's stall, the chaos soak and
the troubleshooting table (tools/misuse.py).

tools/figures.py gathers CHAPTER5 into its runs and POST_STEPS into its tables.
"""
from __future__ import annotations

import shutil
import subprocess
import sys

from common import ROOT
from common.errors import UserError
from step4_multi_node.tables import write_faults_table
from tools.figure_runs import DP4, Run, run_dir, tool_block
from tools.misuse import table as misuse_table

# ---- chapter 5: surviving faults (README: survive faults); the table reads the checkpoints
_5 = ["--model", "small", "--steps", "4", "--global-batch-size", "8", "--seq-len", "128", "--eval-batches", "0",
      "--no-trace-memory", "--ckpt-every", "2", "--amp", "off"]
CHAPTER5 = [
    Run("05_ddp4", "step3_multi_gpu/train_ddp.py", _5, **DP4),
    Run("05_zero1_4", "step3_multi_gpu/train_ddp.py", _5 + ["--zero1"], **DP4),
    Run("05_fsdp4", "step3_multi_gpu/train_fsdp.py", _5, **DP4),
    # --ckpt-async's host copy in the memory trace: the default window (steps 1 and 2) holds the
    # checkpoint after step 1 (--ckpt-every 2)
    Run("05_memory_ckpt_async", "step3_multi_gpu/train_ddp.py",
        ["--model", "small", "--steps", "4", "--global-batch-size", "8", "--seq-len", "128", "--eval-batches", "0",
         "--ckpt-every", "2", "--ckpt-async", "--amp", "off"], nproc=2, job="05_ckpt_async",
        figures={"05_memory_trace_ckpt_async.png": "memory_trace.png"}),
]

# The faults page: a run that crashed and resumed is the run that never stopped, down to what its
# model writes. FSDP on 2 ranks, checkpoints every 4 steps; the second run crashes at step 6 and
# is started again with --resume; both gather their weights, and tools.generate samples from each.
_RESUME = ["step3_multi_gpu/train_fsdp.py", "--model", "small", "--steps", "12", "--ckpt-every", "4",
           "--amp", "off", "--no-trace-memory", "--eval-batches", "0", "--save-weights"]
_RESUME_PROMPT = ["--prompt", "import ", "--max-new-tokens", "120", "--temperature", "0.8", "--top-k", "50",
                  "--seed", "0"]


def bench_ckpt_block(suffix: str = "") -> dict[str, str]:
    """step4_multi_node/README.md's block bench-ckpt: what python -m tools.bench_ckpt prints
    (a checkpoint step's stall, synchronous vs --ckpt-async, on this machine)."""
    argv = ["--device", "cuda" if suffix else "cpu", "--out", str(run_dir("05_bench_ckpt", suffix).relative_to(ROOT))]
    return tool_block("bench-ckpt" + suffix, "tools.bench_ckpt", argv)


def resume_generation(suffix: str = "") -> dict[str, str]:
    """step4_multi_node/README.md's block resume-generate: the uninterrupted and the resumed
    run's models continue one prompt with one seed, and must write the same bytes."""
    import shlex
    device = "cuda" if suffix else "cpu"
    whole, crashed = run_dir("05_resume/whole", suffix), run_dir("05_resume/crashed", suffix)
    for folder in (whole, crashed):
        shutil.rmtree(folder, ignore_errors=True)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    show = "torchrun --standalone --nproc-per-node 2"
    steps = [(whole, [], 0), (crashed, ["--fail-at-step", "6"], None), (crashed, ["--resume"], 0)]
    shown = []
    for folder, extra, want in steps:
        argv = [*_RESUME, "--device", device, "--out", str(folder.relative_to(ROOT)), *extra]
        p = subprocess.run([*torchrun, *argv], cwd=ROOT, capture_output=True, text=True, timeout=900)
        if (want is not None and p.returncode != want) or (want is None and p.returncode == 0):
            raise UserError(f"{show} {shlex.join(argv)} exited {p.returncode}: {p.stderr.strip()[-300:]}")
        shown.append(f"{show} {shlex.join(argv)}" + ("     # crashes at step 6" if want is None else ""))
    texts = []
    for folder in (whole, crashed):
        argv = [str(folder.relative_to(ROOT)), *_RESUME_PROMPT, "--device", device]
        p = subprocess.run([sys.executable, "-m", "tools.generate", *argv], cwd=ROOT, capture_output=True,
                           text=True, timeout=600)
        if p.returncode:
            raise UserError(f"python -m tools.generate failed: {p.stderr.strip()[-300:]}")
        shown.append(f"python -m tools.generate {shlex.join(argv)}")
        # the continuation alone: the header names the folder and the last line the speed
        texts.append("\n".join(p.stdout.rstrip("\n").splitlines()[1:-1]))
    same = "the same bytes" if texts[0] == texts[1] else "DIFFERENT bytes"
    out = "\n".join(shown)
    body = (f"```bash\n{out}\n```\n\nThe uninterrupted run's model, then the resumed one's ({same}):\n\n"
            + "\n\n".join(f"```text\n{t.replace(chr(96) * 3, chr(96) + chr(8203) + chr(96) * 2)}\n```" for t in texts))
    if texts[0] != texts[1]:
        raise UserError(f"the resumed run's model wrote other bytes than the uninterrupted one's:\n{body}")
    return {"resume-generate" + suffix: body}


# The soak of step4_multi_node/README.md (--only chaos): FSDP on 2 CPU ranks, 6 random kills.
CHAOS = ["--script", "step3_multi_gpu/train_fsdp.py", "--kills", "6", "--steps", "60", "--ckpt-every", "5",
         "--seed", "7", "--timeout", "1500"]


def chaos_soak(suffix: str = "") -> dict[str, str]:
    """The faults page's block ``chaos-soak``: what ``python -m tools.chaos *CHAOS`` prints."""
    if suffix:
        return {}
    r = subprocess.run([sys.executable, "-m", "tools.chaos", *CHAOS, "--out", str(run_dir("chaos_soak", suffix))],
                       cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if r.returncode:
        raise UserError(f"python -m tools.chaos failed: {(r.stdout + r.stderr).strip()[-500:]}")
    return {"chaos-soak": f"```bash\npython -m tools.chaos {' '.join(CHAOS)}\n```\n\n{r.stdout.strip()}"}


# (prefix of what it writes in figs/, callable(suffix) -> {README marker: markdown})
POST_STEPS = [("05", write_faults_table), ("misuse", misuse_table), ("05_resume", resume_generation),
              ("05_bench_ckpt", bench_ckpt_block), ("chaos", chaos_soak)]
