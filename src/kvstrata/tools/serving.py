"""Run an OpenAI-compatible engine server as a subprocess and talk to it over loopback HTTP.

Used by the demo, the benchmarks and the P/D router. The server is a separate process started from
the command line a user would type, so nothing here imports an engine. HTTP goes through aiohttp
(``client.py``: imported on first use, so the unit layer imports this module for ``free_port``
without it). ``stream``, ``complete`` and the ``Server`` helpers are the synchronous forms of
``client``'s ``astream`` and ``acomplete``, each on an event loop of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterator

from kvstrata.tools.client import Completion, HTTPStatusError, acomplete, arequest, astream, session  # noqa: F401 (re-exported)

log = logging.getLogger(__name__)

CPU_ENV = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}


# Told the kind of every engine this module starts (``Server.kind``), before it starts: a caller that
# tallies engine starts (the test suite does) appends one.
START_LISTENERS: list[Callable[[str], None]] = []


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port() -> int:
    """A free loopback port below the ephemeral range. A port from bind(("", 0)) is ephemeral:
    once released, the kernel can hand it to the next bind(0) of any process, and the engine
    servers bind such ports themselves (torch.distributed's store, gloo) between our pick and
    their HTTP bind: an SGLang server lost its port to its own scheduler that way. Explicit
    ports below the range are only ever taken by someone asking for that very port."""
    low = _ephemeral_range()[0]
    floor = 10000 if low > 12000 else 1024
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(floor, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # a crowded machine: any free port
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(port: int) -> bool:
    """Whether something accepts connections on the loopback ``port``."""
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def vllm_command(model: str, port: int, kv_transfer_config: dict[str, Any] | None,
                 block_size: int = 128, extra: list[str] | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--host", "127.0.0.1", "--port", str(port), "--block-size", str(block_size),
           "--enforce-eager", "--enable-prompt-tokens-details"]
    if kv_transfer_config is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
    return cmd + (extra or [])


def strata_transfer_config(config_file: str | None = None, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The launch flag value that enables kvstrata (the plugin registers the name); ``overrides``:
    single config keys, dotted (``{"verify.sample_rate": 0}``), over the file's."""
    cfg: dict[str, Any] = {"kv_connector": "StrataConnector", "kv_role": "kv_both",
                           "kv_load_failure_policy": "recompute"}
    extra = {**({"config_file": str(config_file)} if config_file else {}), **(overrides or {})}
    if extra:
        cfg["kv_connector_extra_config"] = extra
    return cfg


def run_async(coro: Any) -> Any:
    """Run ``coro`` to completion on an event loop of its own (the synchronous helpers)."""
    return asyncio.run(coro)


def request(method: str, url: str, body: dict[str, Any] | None = None, timeout: float = 600) -> bytes:
    async def go() -> bytes:
        async with session(timeout) as http:
            return await arequest(http, method, url, body)

    return run_async(go())


class Server:
    """``with Server(cmd, log_path) as s:`` starts, waits for /health, and stops on exit. ``kind``
    names the engine to ``START_LISTENERS``; None tells them nothing (a process that is no engine,
    such as the P/D router)."""

    def __init__(self, cmd: list[str], log_path: Path, port: int, env: dict[str, str] | None = None,
                 timeout: float = 600, kind: str | None = "") -> None:
        self.cmd, self.log_path, self.port, self.timeout = cmd, log_path, port, timeout
        self.env = {**os.environ, **({} if cuda_available() else CPU_ENV), **(env or {})}
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.kind = ("vllm server" if "vllm" in " ".join(cmd) else "server") if kind == "" else kind

    def __enter__(self) -> "Server":
        self._log = open(self.log_path, "wb")
        if self.kind is not None:
            for listener in START_LISTENERS:
                listener(self.kind)
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        try:
            run_async(self._wait_healthy())
        except BaseException:
            self.__exit__()
            raise
        return self

    async def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.timeout
        async with session(5) as http:
            while time.monotonic() < deadline:
                assert self.proc is not None
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited with {self.proc.returncode}; log tail:\n{self.tail()}")
                with contextlib.suppress(OSError):
                    await arequest(http, "GET", self.url + "/health")
                    return
                await asyncio.sleep(0.5)
        raise TimeoutError(f"server not healthy after {self.timeout:.0f} s; log tail:\n{self.tail()}")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()

    def tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def post(self, path: str, body: dict[str, Any] | None = None, timeout: float = 600) -> bytes:
        return request("POST", self.url + path, body or {}, timeout)

    def metrics(self) -> str:
        return request("GET", self.url + "/metrics", timeout=10).decode()


def stream(url: str, body: dict[str, Any], timeout: float = 600) -> Iterator[dict[str, Any]]:
    """``astream`` for synchronous callers: each ``next`` runs a private event loop up to the next
    chunk, so chunks still come as the server sends them."""
    loop = asyncio.new_event_loop()

    async def chunks() -> AsyncIterator[dict[str, Any]]:
        async with session(timeout) as http:
            async for chunk in astream(http, url, body):
                yield chunk

    agen = chunks()
    try:
        while True:
            try:
                chunk = loop.run_until_complete(agen.__anext__())
            except StopAsyncIteration:
                return
            yield chunk
    finally:
        loop.run_until_complete(agen.aclose())
        loop.close()


def complete(server: Server, model: str, prompt: list[int], max_tokens: int = 16,
             cache_salt: str | None = None, timeout: float = 600) -> Completion:
    """``acomplete`` for synchronous callers."""
    async def go() -> Completion:
        async with session(timeout) as http:
            return await acomplete(http, server.url, model, prompt, max_tokens, cache_salt)

    return run_async(go())


def cached_by_source(metrics_text: str) -> dict[str, float]:
    """``vllm:prompt_tokens_cached_by_source`` from a Prometheus scrape, summed per source."""
    out: dict[str, float] = {}
    for line in metrics_text.splitlines():
        if line.startswith("vllm:prompt_tokens_cached_by_source_total{"):
            labels, value = line.rsplit(" ", 1)
            source = labels.split('source="', 1)[1].split('"', 1)[0]
            out[source] = out.get(source, 0.0) + float(value)
    return out
