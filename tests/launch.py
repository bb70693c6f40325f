"""``run`` and ``Popen`` as in subprocess, for the suite's launches of Python programs.

A launch of ``[sys.executable, script | -m module | -c code, ARGS]`` is forked from the
suite's fork server (tests/forkserver.py: torch already imported) when a fresh interpreter
could not behave differently: the same Python, no interpreter flags but ``-u``, and the
server's values of every variable torch or the libraries under it may read at import time
(IMPORT_TIME); the child gets the launch's whole environment.
Anything else starts as subprocess starts it. The object is a ``subprocess.Popen``: pid,
pipes, ``communicate``, ``wait``, timeouts, ``kill`` and ``send_signal`` behave as for a child
of this process; its exit status comes from the server, whose child it is.

One server per pytest worker, started at the first launch and stopped with the worker;
``TUTORIAL_FORKSERVER=0`` turns it off (every launch a fresh interpreter, as before).
"""
from __future__ import annotations

import atexit
import json
import os
import select
import socket
import struct
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

PIPE, STDOUT, DEVNULL, TimeoutExpired, CompletedProcess = (subprocess.PIPE, subprocess.STDOUT, subprocess.DEVNULL,
                                                            subprocess.TimeoutExpired, subprocess.CompletedProcess)
SERVER = Path(__file__).with_name("forkserver.py")
_server: dict = {}
# The environment the server is started with: the suite's, as tests/conftest.py set it, taken
# when the test files are collected (a test that changes os.environ for a while does not change it)
BASE_ENV = dict(os.environ)


# Variables that what the server imported (torch, numpy, tqdm and the libraries under them)
# may read at import time, so a launch that sets them otherwise starts a fresh interpreter;
# anything else is read when it is used, after the fork, from the child's environment. A few
# of torch's are read when used too, and a run sets them in-process: common/distributed.py's
# flight recorder, common/cli.py's allocator setting, and inductor's cache folder (which
# torch.compile writes into os.environ for its compile workers).
IMPORT_TIME = ("TORCH", "PYTORCH", "OMP_", "KMP_", "MKL", "OPENBLAS", "GOMP", "CUDA", "NCCL", "GLOO", "NVIDIA",
               "PYTHON", "LD_", "TQDM", "NUMPY", "SYMPY", "TRITON", "DNNL", "ONEDNN", "XLA", "HF_", "LC_", "LANG")
READ_WHEN_USED = {"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE", "PYTORCH_CUDA_ALLOC_CONF",
                  "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"}


def _env_key(env: dict) -> dict:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME) and k not in READ_WHEN_USED}


def _start_server():
    """The worker's server (None if it cannot start: every launch is then a fresh interpreter)."""
    if "proc" in _server:
        if _server["proc"].poll() is None:
            return _server["proc"]
        if not _server.get("told"):  # say it once: every later launch is a fresh interpreter, slower
            _server["told"] = True
            warnings.warn(f"the fork server ended (exit {_server['proc'].returncode}); launches start fresh "
                          f"interpreters from now on. Its log: {Path(_server['log']).read_text()[-2000:]}")
        return None
    folder = tempfile.mkdtemp(prefix="forkserver")
    path, log = os.path.join(folder, "s"), os.path.join(folder, "log")
    env = dict(BASE_ENV)
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, str(SERVER), path], stdout=subprocess.PIPE, stderr=f,
                                stdin=subprocess.DEVNULL, env=env, text=True)
    _server.update(proc=proc, path=path, log=log, env=_env_key(env))
    ready = proc.stdout.readline().strip() == "ready"
    atexit.register(_stop_server)
    if not ready:
        proc.kill()
        return None
    return proc


def _stop_server():
    proc = _server.get("proc")
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait()


def _request(args, env) -> dict | None:
    """What the server runs for this command line, or None where it must be a fresh interpreter."""
    if os.environ.get("TUTORIAL_FORKSERVER", "1") != "1" or isinstance(args, (str, bytes)):
        return None
    args = [str(a) for a in args]
    if len(args) < 2 or os.path.realpath(args[0]) != os.path.realpath(sys.executable):
        return None
    i, unbuffered = 1, False
    if args[1] == "-u":
        i, unbuffered = 2, True
    if len(args) <= i:
        return None
    first = args[i]
    if first in ("-m", "-c"):
        if len(args) <= i + 1:
            return None
        kind, target, rest = ("module" if first == "-m" else "code"), args[i + 1], args[i + 2:]
    elif first.startswith("-"):
        return None  # other interpreter flags change what a fresh interpreter does
    else:
        kind, target, rest = "script", first, args[i + 1:]
    env = dict(os.environ if env is None else env)
    if _start_server() is None or _env_key(env) != _server["env"]:
        return None
    return {"kind": kind, "target": target, "args": rest, "env": env, "unbuffered": unbuffered}


class Popen(subprocess.Popen):
    """subprocess.Popen, forked from the fork server where the launch allows (see the module)."""

    def __init__(self, args, *a, env=None, **kw):
        self._forked = _request(args, env)
        self._conn = None
        super().__init__(args, *a, env=env, **kw)

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                       creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite, *rest):
        if self._forked is None or preexec_fn is not None or pass_fds or shell or executable:
            self._forked = None
            return super()._execute_child(args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                                          creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread,
                                          errwrite, *rest)
        start_new_session = rest[4]
        req = {**self._forked, "cwd": os.fspath(cwd) if cwd is not None else os.getcwd(),
               "new_session": bool(start_new_session)}
        fds = [p2cread if p2cread != -1 else 0, c2pwrite if c2pwrite != -1 else 1, errwrite if errwrite != -1 else 2]
        try:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.connect(_server["path"])
            socket.send_fds(conn, [b"x"], fds)
            payload = json.dumps(req).encode()
            conn.sendall(struct.pack("!I", len(payload)) + payload)
            self._conn, self._buf = conn, b""
            pid = self._line(None)
            if not pid:
                raise OSError(f"the fork server ({SERVER}) did not start {args}")
            self.pid = int(pid)
            self._child_created = True
        finally:
            self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)

    def _line(self, timeout) -> str | None:
        """The server's next line ('' if it hung up), or None if none came within timeout."""
        while b"\n" not in self._buf:
            ready, _, _ = select.select([self._conn], [], [], timeout)
            if not ready:
                return None
            chunk = self._conn.recv(64)
            if not chunk:
                return ""
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode()

    def _status(self, timeout):
        """The child's exit code once the server reports it (None while it runs)."""
        if self.returncode is None:
            line = self._line(timeout)
            if line is None:
                return None
            # a server that died takes its children's statuses with it: report a kill
            self.returncode = os.waitstatus_to_exitcode(int(line)) if line else -9
            self._conn.close()
        return self.returncode

    def _internal_poll(self, *a, **kw):
        if self._forked is None:
            return super()._internal_poll(*a, **kw)
        return self._status(0)

    def _wait(self, timeout):
        if self._forked is None:
            return super()._wait(timeout)
        if self._status(timeout) is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode


def run(*popenargs, input=None, capture_output=False, timeout=None, check=False, **kwargs):
    """subprocess.run with this module's Popen."""
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = PIPE
    with Popen(*popenargs, **kwargs) as process:
        try:
            stdout, stderr = process.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            process.kill()
            exc.stdout, exc.stderr = process.communicate()
            raise
        except BaseException:
            process.kill()
            raise
        retcode = process.poll()
        if check and retcode:
            raise subprocess.CalledProcessError(retcode, process.args, output=stdout, stderr=stderr)
    return CompletedProcess(process.args, retcode, stdout, stderr)
