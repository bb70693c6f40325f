"""Launched by tests/test_memory.py: traced trainings one after another in this one process,
as tools/gpu_check.py and tools/multirun.py run them. After each run returns, with Python's
automatic collector off (nothing may be freed by a collection that happened to run), it
writes what of the run is still alive (models, optimizers, tensor bytes), then what is
alive after a full collection.

Each argument is SCRIPT (its main() called directly) or multirun:SCRIPT (through
tools.multirun.run_script, which collects after every run: FSDP2 builds reference cycles
of its own, module <-> FSDPParam, so its model lives until a collection)."""
import gc
import importlib.util
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh  # noqa: E402

from common.model import Transformer  # noqa: E402
from tools.multirun import run_script  # noqa: E402


def alive() -> dict:
    objs = gc.get_objects()  # the tracked objects, found without a collection
    # (a DeviceMesh that DTensor's sharding cache keeps from run to run holds a tiny tensor of
    # its coordinates: PyTorch's cache, not a run's memory)
    cached = {v.untyped_storage()._cdata for o in objs if isinstance(o, DeviceMesh)
              for v in vars(o).values() if isinstance(v, torch.Tensor)}
    tensors = {}
    for o in objs:
        if issubclass(type(o), torch.Tensor) and not o.is_meta and o.untyped_storage()._cdata not in cached:
            tensors[o.untyped_storage()._cdata] = o.untyped_storage().nbytes()
    return {"models": sum(isinstance(o, Transformer) for o in objs),
            "optimizers": sum(isinstance(o, torch.optim.Optimizer) for o in objs),
            "tensor_bytes": sum(tensors.values()), "frozen": gc.get_freeze_count()}


def main(out: str, scripts: list[str]):
    gc.disable()
    rows = [{"script": None, **alive()}]
    for i, arg in enumerate(scripts):
        via_multirun, script = arg.startswith("multirun:"), arg.removeprefix("multirun:")
        argv = ["--device", "cpu", "--model", "debug", "--steps", "3", "--seq-len", "32", "--global-batch-size", "2",
                "--eval-batches", "1", "--data", "synthetic", "--out", os.path.join(out, f"run{i}")]
        if via_multirun:
            code, _ = run_script(script, argv)
        else:
            spec = importlib.util.spec_from_file_location(f"run{i}", os.path.join(ROOT, script))
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            sys.argv, code = [script, *argv], 0
            try:
                module.main()
            except SystemExit as e:
                code = e.code
            del module, spec
        assert not code, f"{script} exited with {code}"
        row = {"script": arg, **alive()}
        gc.collect()
        rows.append(row | {"after_collect": alive()})
    with open(os.path.join(out, "alive.json"), "w") as f:
        json.dump(rows, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
