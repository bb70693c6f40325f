"""Launched by tests/test_checkpoint.py's second-Ctrl-C test: a step script whose every
forward first sleeps, so that each step lasts a second or more without the CPU it would take
to make it that long (the test presses Ctrl-C twice, 0.15 s apart, and needs both presses
inside one step on any machine). The script is otherwise the real one, under real torchrun.

    torchrun --nproc-per-node N tests/drivers/slow_steps.py SECONDS SCRIPT [FLAGS...]"""
import os
import runpy
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from common.model import Transformer  # noqa: E402

SECONDS = float(sys.argv[1])
_forward = Transformer.forward


def slow_forward(self, *args, **kwargs):
    time.sleep(SECONDS)  # (a signal's handler runs in the sleep, as it would in a long matmul's wake)
    return _forward(self, *args, **kwargs)


Transformer.forward = slow_forward
sys.argv = sys.argv[2:]
runpy.run_path(os.path.join(ROOT, sys.argv[0]), run_name="__main__")
