"""Launched under torchrun by tests/test_checkpoint.py: several checkpointed runs in one job.

    torchrun [--max-restarts N] --nproc-per-node W tests/drivers/resume.py DIR PLAN

PLAN is JSON, {name: {"script": "step1"|"ddp"|"fsdp"|"tp"|"pp", "flags": [...], "from": [run, step or "latest"],
"damage": "truncate"|"meta"}},
run in order on one process group (tests/drivers/dp.py's ``run``: each script's real
main(), which joins the driver's process group). Each run writes into DIR/<name>; "from" first copies that run's checkpoint
step_<step> into it, so that ``--resume`` starts there (another world size, another
strategy), and "damage" then breaks that copy. Rank 0 writes DIR/<name>.json: exit code, stderr tail, losses by step.

Before the runs, every rank says which device it would take on nodes with as many GPUs as
it has local ranks (``rank_device``, the scripts' own choice, with the GPU count given:
LOCAL_RANK's GPU, never RANK's) and on nodes of one GPU (refused); rank 0 writes them to
DIR/devices_<world size>.json.

Elastic restarts: a run with ``--fail-at-step`` crashes one rank hard (os._exit), torchrun
kills the others and starts the whole job again. This driver then skips the runs that
finished (their .json exists) and re-enters the crashed one with --resume. The
checkpointer arms the fault only while TORCHELASTIC_RESTART_COUNT is 0, so the driver
sets it per run: 1 for the run that already crashed once (a DIR/<name>.started marker),
0 for runs it has not started yet; one job thereby tests two crashes in two runs.
"""
import contextlib
import io
import json
import os
import shutil
import sys
import time
from pathlib import Path

from datetime import timedelta

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dp  # noqa: E402  (puts the repository on sys.path; runs a script's main() on our group)
from common.checkpoint_meta import complete_checkpoints  # noqa: E402
from common.distributed import _restart_store, rank_device  # noqa: E402
from common.errors import UserError  # noqa: E402


class Tee(io.StringIO):
    """Keeps what a run prints and still shows it (the job's log keeps "crashing on purpose")."""

    def write(self, text):
        sys.__stdout__.write(text)
        return super().write(text)


def damage(ckpt: Path, how: str | None):
    """Break a copied checkpoint the way real failures do."""
    if how == "truncate":  # a full disk or a killed copy: the data file ends early
        data = sorted(ckpt.glob("*.distcp"))[0]
        data.write_bytes(data.read_bytes()[:100])
    elif how == "meta":  # a hand edit or a bit flip: meta.json is not JSON any more
        (ckpt / "meta.json").write_bytes(b"\xff{not json")


def main(folder: str, plan: str):
    folder = Path(folder)
    store = _restart_store(timedelta(seconds=60))  # fresh keys after a restart (see there)
    if store is None:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", store=store, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]))
    rank = dist.get_rank()
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    choice = {"rank": rank, "local_rank": int(os.environ["LOCAL_RANK"]),
              "visible_gpus": os.environ.get("CUDA_VISIBLE_DEVICES")}  # (hidden by two_nodes_on_one_machine.sh)
    choice["device"] = str(rank_device("cuda", device_count=int(os.environ["LOCAL_WORLD_SIZE"]))[1])
    try:
        rank_device("cuda", device_count=1)
    except UserError as e:
        choice["one_gpu"] = str(e)
    choices = [None] * dist.get_world_size()
    dist.all_gather_object(choices, choice)
    if rank == 0:
        (folder / f"devices_{dist.get_world_size()}.json").write_text(json.dumps(choices))
    for name, run in json.loads(plan).items():
        result = folder / f"{name}.json"
        out = folder / name
        if result.exists():
            continue  # finished before a restart
        marker = folder / f"{name}.started"
        started = marker.exists()
        dist.barrier()  # every rank has looked at the marker before rank 0 writes it
        if rank == 0:
            marker.touch()
            if "from" in run and not started:
                src, step = run["from"]
                if step == "latest":  # where a preempted run stopped
                    step = int(complete_checkpoints(folder / src / "checkpoints")[-1].name.split("_")[1])
                shutil.rmtree(out, ignore_errors=True)
                shutil.copytree(folder / src / "checkpoints" / f"step_{step:08d}",
                                out / "checkpoints" / f"step_{step:08d}")
                damage(out / "checkpoints" / f"step_{step:08d}", run.get("damage"))
        dist.barrier()
        os.environ["TORCHELASTIC_RESTART_COUNT"] = "1" if started else "0"
        t0 = time.time()
        with contextlib.redirect_stdout(Tee()) as printed:
            code, err = dp.run(run["script"], dp.COMMON + run["flags"], out)
        if code == 1 and not started and "--fail-at-step" in run["flags"]:
            # A rank that sees its peer die fails too (gloo: connection reset) before
            # torchrun stops it: leave the run unfinished, for the restart to resume.
            os._exit(1)
        if rank == 0:
            metrics = out / "metrics.jsonl"
            lines = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
            ckpts = sorted(p.name for p in (out / "checkpoints").iterdir()) if (out / "checkpoints").is_dir() else []
            result.write_text(json.dumps({"code": code, "stderr": err[-3000:], "stdout": printed.getvalue()[-3000:],
                                          "restarted": started,
                                          "job_attempt": int(attempt), "began": t0, "seconds": time.time() - t0,
                                          "checkpoints": ckpts,
                                          "losses": {str(r["step"]): r["loss"] for r in lines}}))
        dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        (folder / "driver_done").write_text(str(time.time()))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
