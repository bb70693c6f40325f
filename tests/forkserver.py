"""The suite's fork server: processes that start with torch already imported.

Most of what the suite's launches cost on a 2-core machine is Python importing torch, DTensor,
dynamo and the checkpoint package, about 2.5 s of CPU a process, in some 300 processes. This
server imports them once (per pytest worker) and then, for each launch tests/launch.py hands
it, forks: the child takes the launch's stdin/stdout/stderr, working directory and
environment, and runs the script, ``-m`` module or ``-c`` code as ``python`` would (the same
``sys.argv``, ``sys.path[0]``, ``__main__``, exit status, exit handlers). A launch of
``python -m torch.distributed.run`` runs torchrun's own ``main`` with two of torchrun's options
added, ``--run-path --start-method fork``: its ranks are forks of it, so they too start with
torch imported. They are still separate processes with their own process groups and memory.

tests/launch.py sends a launch here only when nothing read at import time can differ from a
fresh interpreter: the same Python, no interpreter flags but ``-u``, and this server's values
of the variables torch and the libraries under it may read at import time. Everything else,
and the tests of what torchrun does to a running job (signals), start a fresh interpreter.

Protocol, one connection a launch: the client sends its three standard streams' descriptors
(SCM_RIGHTS) and a length-prefixed JSON request; the server answers the child's pid on a line,
and, when the child has ended, its wait status on a second line. The server never runs an op
or starts a thread, so every fork is of a single-threaded process that has not started OpenMP.
"""
from __future__ import annotations

import io
import json
import os
import selectors
import signal
import socket
import struct
import sys

TORCHRUN = "torch.distributed.run"


def _read_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the client went away")
        data += chunk
    return data


def _streams(unbuffered: bool) -> None:
    """Standard streams as a fresh interpreter makes them on fds 0-2 (``-u``: no buffer at all)."""
    enc = sys.stdout.encoding

    def writer(fd: int, errors: str, line: bool):
        raw = io.FileIO(fd, "w", closefd=False)
        return io.TextIOWrapper(raw if unbuffered else io.BufferedWriter(raw), encoding=enc, errors=errors,
                                line_buffering=line, write_through=unbuffered)

    sys.stdin = sys.__stdin__ = open(0, "r", closefd=False, encoding=enc)
    sys.stdout = sys.__stdout__ = writer(1, "strict", os.isatty(1))
    sys.stderr = sys.__stderr__ = writer(2, "backslashreplace", True)


def _run_rank(script: str, *args: str) -> None:
    """A rank of a forked torchrun: the script as ``python -u script.py ARGS`` runs it."""
    import atexit
    import runpy
    atexit._clear()  # the agent's exit handlers are the agent's
    _streams(unbuffered=True)  # torchrun starts its ranks with `python -u`
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.realpath(script))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        # torchrun's --run-path takes SystemExit(0) alone as success: after a script's
        # sys.exit() or sys.exit(None) its agent would wait for the rank's result for ever
        if e.code not in (None, 0):
            raise
    finally:
        atexit._run_exitfuncs()


def _main_code(req: dict) -> None:
    """Run the launch's program in this (forked) interpreter, as ``python`` would."""
    import runpy
    kind, target, args = req["kind"], req["target"], req["args"]
    if kind == "script":
        sys.argv = [target, *args]
        sys.path[0] = os.path.dirname(os.path.realpath(target))
        runpy.run_path(target, run_name="__main__")
    elif kind == "module" and target == TORCHRUN:
        import torch.distributed.run as torchrun
        sys.argv = [torchrun.__file__, *args]
        sys.path[0] = os.getcwd()
        torchrun.run_script_path = _run_rank  # what --run-path runs in each rank
        torchrun.main(["--run-path", "--start-method", "fork", *args])
    elif kind == "module":
        sys.argv = [target, *args]
        sys.path[0] = os.getcwd()
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:  # -c
        import types
        sys.argv = ["-c", *args]
        sys.path[0] = ""
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        exec(compile(target, "<string>", "exec"), main.__dict__)


def _child(req: dict, fds: list[int], keep: set[int]) -> None:
    """In the fork: take the launch's streams, folder and environment, run, exit with its status."""
    import atexit
    import threading
    import traceback
    code = 1
    try:
        for fd in keep:
            os.close(fd)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in set(fds):
            if fd > 2:
                os.close(fd)
        if req.get("new_session"):
            os.setsid()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        _streams(req["unbuffered"])
        code = 0
        try:
            _main_code(req)
        except SystemExit as e:
            if e.code is None:
                code = 0
            elif isinstance(e.code, int):
                code = e.code
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except KeyboardInterrupt:
            traceback.print_exc()
            code = -signal.SIGINT
        except BaseException:
            sys.excepthook(*sys.exc_info())
            code = 1
        threading._shutdown()
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        if code < 0:  # an uncaught Ctrl-C: end as the signal ends a fresh interpreter
            signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
        os._exit(code & 0xFF)


def serve(path: str) -> None:
    import numpy  # noqa: F401
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.pipelining  # noqa: F401
    import torch.distributed.run  # noqa: F401
    import torch.distributed.tensor  # noqa: F401
    import tqdm  # noqa: F401
    sys.stdout.flush()
    sys.stderr.flush()

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, None)
    print("ready", flush=True)  # the client waits for this line
    while True:
        for key, _ in sel.select():
            if key.data is None:
                conn, _ = listener.accept()
                try:
                    _, fds, _, _ = socket.recv_fds(conn, 1, 3)
                    (n,) = struct.unpack("!I", _read_exact(conn, 4))
                    req = json.loads(_read_exact(conn, n))
                except (ConnectionError, OSError, ValueError):
                    conn.close()
                    continue
                # the server's own descriptors, closed in the child (their socket objects stay
                # referenced, never collected, so nothing closes a number twice)
                keep = {sel.fileno(), conn.fileno()}
                for k in sel.get_map().values():
                    keep |= {k.fd} | ({k.data[1].fileno()} if k.data else set())
                pid = os.fork()
                if pid == 0:
                    _child(req, fds, keep)
                for fd in fds:
                    os.close(fd)
                conn.sendall(f"{pid}\n".encode())
                sel.register(os.pidfd_open(pid), selectors.EVENT_READ, (pid, conn))
            else:
                pid, conn = key.data
                sel.unregister(key.fd)
                os.close(key.fd)
                _, status = os.waitpid(pid, 0)
                try:
                    conn.sendall(f"{status}\n".encode())
                except OSError:
                    pass
                conn.close()


if __name__ == "__main__":
    serve(sys.argv[1])
