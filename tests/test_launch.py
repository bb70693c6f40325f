"""The suite's launcher (tests/launch.py and its fork server): a forked launch behaves as a fresh
interpreter would, wherever a test could tell them apart, and trains the same bits."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

import launch
from conftest import ROOT

PROBE = ("import json, os, sys; print(json.dumps({'argv': sys.argv, 'path0': sys.path[0], 'name': __name__, "
         "'cwd': os.getcwd(), 'env': os.environ.get('PROBE_VALUE'), 'ppid': os.getppid(), "
         "'sid': os.getsid(0) == os.getpid()})); print('to stderr', file=sys.stderr)")


def _probe(tmp_path, kind: str, **kw):
    if kind == "script":
        script = tmp_path / "probe.py"
        script.write_text(PROBE.replace("__name__", "__name__, 'file': __file__"))
        cmd = [sys.executable, str(script), "a", "--b"]
    else:
        cmd = [sys.executable, "-c", PROBE, "a", "--b"]
    r = launch.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=60, **kw)
    assert r.returncode == 0, r.stderr
    assert r.stderr == "to stderr\n"
    return json.loads(r.stdout)


def test_a_forked_launch_sees_what_a_fresh_interpreter_sees(tmp_path):
    script = tmp_path / "probe.py"
    got = _probe(tmp_path, "script")
    assert got["argv"] == [str(script), "a", "--b"] and got["name"] == "__main__" and got["file"] == str(script)
    assert got["path0"] == str(tmp_path) and got["cwd"] == str(tmp_path)
    assert got["ppid"] != os.getpid()  # the fork server's child, not ours: it really was forked
    code = _probe(tmp_path, "code")
    assert code["argv"] == ["-c", "a", "--b"] and code["path0"] == "" and code["name"] == "__main__"
    assert _probe(tmp_path, "code", start_new_session=True)["sid"] is True


def test_a_variable_read_at_import_time_starts_a_fresh_interpreter(tmp_path):
    """A variable torch may read when it is imported (TORCH_*, OMP_*, ...) set otherwise than
    in the server: the launch is not forked (its parent is this process). Any other variable
    reaches the forked child."""
    got = _probe(tmp_path, "code", env=dict(os.environ, TORCH_PROBE_VALUE="1"))
    assert got["ppid"] == os.getpid()
    got = _probe(tmp_path, "code", env=dict(os.environ, PROBE_VALUE="1"))
    assert got["env"] == "1" and got["ppid"] != os.getpid()


def test_exit_status_errors_timeouts_and_signals_as_for_a_child(tmp_path):
    assert _probe(tmp_path, "code")["ppid"] != os.getpid()  # these launches are forked, not fresh
    def run(code, **kw):
        return launch.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, **kw)

    assert run("import sys; sys.exit(3)").returncode == 3
    r = run("raise ValueError('boom')")
    assert r.returncode == 1 and r.stderr.splitlines()[-1] == "ValueError: boom" and "Traceback" in r.stderr
    r = run("import sys; sys.exit('a message')")
    assert r.returncode == 1 and r.stderr == "a message\n"
    assert run("import os, signal; os.kill(os.getpid(), signal.SIGTERM)").returncode == -signal.SIGTERM
    assert run("raise KeyboardInterrupt").returncode == -signal.SIGINT
    r = run("import atexit; atexit.register(print, 'at exit'); print('body')")
    assert r.stdout == "body\nat exit\n"
    r = run("import threading, time; threading.Thread(target=lambda: (time.sleep(0.5), print('joined'))).start()")
    assert r.stdout == "joined\n"  # the interpreter waits for its threads before it ends
    with pytest.raises(subprocess.TimeoutExpired):
        launch.run([sys.executable, "-c", "import time; time.sleep(60)"], timeout=1)
    p = launch.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"],
                     stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline() == "up\n" and p.poll() is None
    t = time.monotonic()
    p.kill()
    assert p.wait(timeout=30) == -signal.SIGKILL and time.monotonic() - t < 30
    p.stdout.close()


def _losses(folder):
    return [json.loads(line)["loss"] for line in (folder / "metrics.jsonl").read_text().splitlines()]


def test_forked_runs_train_the_same_bits_as_fresh_interpreters(tmp_path):
    """Step 1 under python and DDP under torchrun on 2 ranks, each forked and fresh: the same
    losses, bit for bit."""
    flags = ["--model", "debug", "--steps", "3", "--seq-len", "32", "--global-batch-size", "4", "--device", "cpu",
             "--no-trace-memory", "--eval-batches", "0"]
    step1 = [sys.executable, "step1_single_gpu/train.py", *flags]
    ddp = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "step3_multi_gpu/train_ddp.py", *flags]
    runs = {}
    for name, cmd in (("step1", step1), ("ddp", ddp)):
        for how, start in (("forked", launch.Popen), ("fresh", subprocess.Popen)):
            out = tmp_path / f"{name}_{how}"
            runs[name, how] = (start([*cmd, "--out", str(out)], cwd=ROOT, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True), out)
    for (name, how), (p, out) in runs.items():
        _, err = p.communicate(timeout=240)
        assert p.returncode == 0, (name, how, err[-3000:])
    for name in ("step1", "ddp"):
        assert _losses(runs[name, "forked"][1]) == _losses(runs[name, "fresh"][1]), name
    assert runs["ddp", "forked"][0]._forked is not None  # it went through the server


def test_a_forked_torchrun_ends_when_its_ranks_call_sys_exit(tmp_path):
    """torchrun's --run-path takes only SystemExit(0) as a rank's success; a rank ending with
    sys.exit() (as tests/drivers/compile.py does) must not leave the agent waiting for ever,
    and a rank's non-zero exit is still torchrun's failure."""
    script = tmp_path / "ends.py"
    # one write of one short line: the two ranks share the pipe, and print('rank', r) writes
    # its pieces apart, so two ranks' pieces could interleave ("rankrank 0 / 1")
    script.write_text("import os, sys\nsys.stdout.write(f\"rank {os.environ['RANK']}\\n\"); sys.stdout.flush()\n"
                      "sys.exit(int(os.environ['RANK']) * int(sys.argv[1]) or None)\n")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    ok = launch.run([*cmd, "0"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and sorted(ok.stdout.split("\n")[:2]) == ["rank 0", "rank 1"], ok.stderr[-2000:]
    bad = launch.run([*cmd, "3"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "exitcode  : 3" in bad.stderr, bad.stderr[-2000:]
