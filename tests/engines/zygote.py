"""A fork server for the offline vLLM engines of the tests: vLLM is imported once, engines are forked.

``from vllm import LLM`` takes about 11 s here, most of an offline engine's start. The zygote
(``python zygote.py SOCKET``, one per test worker, started by ``Zygote.start``) imports vLLM and
kvstrata's adapter, then forks one child per request. The child becomes what
``python vllm_steps.py SPEC`` would have been: its own session (process group), the requester's
pipes as stdin/stdout/stderr, the requester's environment, working directory and argv. vLLM's own
worker processes (TP, PP, the multiprocess EngineCore) are started by the child as usual.

Fork safety: the zygote imports modules and does nothing else (no torch op, no thread of its own),
and vLLM forks its workers after the same imports by default.

The requester gets a ``Child`` that answers like ``subprocess.Popen`` for what ``StepEngine`` uses
(``pid``, ``stdin``, ``stdout``, ``poll``, ``wait``, ``returncode``): the zygote reaps the child and
sends its exit status on the request's socket.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

STATUS = struct.Struct("!i")  # pid at fork, then the wait status at exit, on the request's socket


# ------------------------------------------------------------------------------------ server
def _child(conn: socket.socket, others: list[socket.socket], fds: list[int], request: dict) -> None:
    for sock in others:  # the listener and the other children's sockets are the zygote's
        sock.close()
    os.setsid()
    for sig in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    stdin, stdout = fds
    os.dup2(stdin, 0)
    os.dup2(stdout, 1)
    os.dup2(stdout, 2)
    os.close(stdin)
    os.close(stdout)
    conn.close()
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.argv = request["argv"]
    code = 0
    try:
        import runpy

        runpy.run_path(request["argv"][0], run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def serve(path: str) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams  # noqa: F401  (the point: imported once, before any fork)

    import kvstrata.adapters.vllm  # noqa: F401

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    print("ZYGOTE", flush=True)
    children: dict[int, socket.socket] = {}
    while True:
        ready, _, _ = select.select([listener, sys.stdin], [], [], 0.2)
        if sys.stdin in ready and not sys.stdin.readline():
            break  # the requester is gone
        if listener in ready:
            conn, _ = listener.accept()
            msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 2)
            request = json.loads(msg)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(conn, [listener, *children.values()], fds, request)
            for fd in fds:
                os.close(fd)
            conn.sendall(STATUS.pack(pid))
            children[pid] = conn
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                with contextlib.suppress(OSError):  # the requester may be gone
                    conn.sendall(STATUS.pack(status))
                conn.close()


# ------------------------------------------------------------------------------------ client
class Child:
    """A forked engine, answering like ``subprocess.Popen`` (text pipes) for what the tests use."""

    def __init__(self, conn: socket.socket, stdin: IO[str], stdout: IO[str]) -> None:
        self._conn, self.stdin, self.stdout = conn, stdin, stdout
        self.pid = STATUS.unpack(_read(conn, STATUS.size))[0]
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._conn], [], [], 0)[0]:
            self._collect()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self._conn], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(f"zygote child {self.pid}", timeout or 0)
            self._collect()
        assert self.returncode is not None
        return self.returncode

    def _collect(self) -> None:
        data = _read(self._conn, STATUS.size)
        status = STATUS.unpack(data)[0] if data else -1
        self.returncode = os.waitstatus_to_exitcode(status) if data else -9
        self._conn.close()


def _read(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            return b""
        data += chunk
    return data


class Zygote:
    """One zygote process per test worker, started on first use; ``spawn`` forks an engine from it."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.path = str(folder / "zygote.sock")
        self.proc: subprocess.Popen[str] | None = None

    def start(self, timeout: float = 300) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        log = open(self.folder / "zygote.log", "w")
        self.proc = subprocess.Popen([sys.executable, __file__, self.path], stdin=subprocess.PIPE, stdout=log,
                                     stderr=subprocess.STDOUT, text=True, cwd=Path(__file__).parents[2],
                                     start_new_session=True)
        deadline = time.monotonic() + timeout
        while not os.path.exists(self.path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the test engines' zygote did not start: {(self.folder / 'zygote.log').read_text()}")
            time.sleep(0.05)

    def spawn(self, argv: list[str], env: dict[str, str], cwd: Path) -> Child:
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        stdin_r, stdin_w = os.pipe()
        stdout_r, stdout_w = os.pipe()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self.path)
        request = json.dumps({"argv": argv, "env": env, "cwd": str(cwd)}).encode()
        socket.send_fds(conn, [request], [stdin_r, stdout_w])
        os.close(stdin_r)
        os.close(stdout_w)
        return Child(conn, os.fdopen(stdin_w, "w"), os.fdopen(stdout_r, "r"))

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


if __name__ == "__main__":
    serve(sys.argv[1])
