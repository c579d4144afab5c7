"""The servers ``python -m benchmarks serve`` compares: one engine process per (configuration, run).

Every configuration of one engine gets the same command line (block/page size, device KV cache
size, context length, dtype, seed) and the same environment; only the KV connector or storage
backend differs. Each run gets fresh store folders under its own work folder, so no run warms
another. ``Endpoint`` is the small interface the replay uses: ``send`` one streamed request, and
``tier_counts`` (vLLM's ``/metrics``, ``scrape``; SGLang reports tiers per request instead).
Requests are async (``kvstrata.tools.client``): the replay runs every one on one event loop.

Verified hits: every kvstrata configuration runs with ``verify.sample_rate`` 0 (the cache's own
figures); ``STRATA_L1L2`` beyond ``strata-l1l2`` is the same server at another rate.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, NamedTuple

from tests.harness.redis_server import redis_server
from kvstrata.tools.client import astream, session
from kvstrata.tools.serving import Server, cached_by_source, free_port, listening, request, vllm_command
from benchmarks import ttft

# kvstrata's CPU + disk tiers, by their verify.sample_rate: configurations that differ in that key alone
STRATA_L1L2 = {"strata-l1l2": 0.0, "strata-verify-0.01": 0.01, "strata-verify-1": 1.0}
CONFIGS = ("baseline", "hicache", *STRATA_L1L2, "strata-remote", "peer", "lmcache", "disagg")
# SGLang only: HiCache's host pool with no storage backend, what SGLang's own hierarchy gives
SGLANG_ONLY = ("hicache",)


class Settings(NamedTuple):
    engine: str  # vllm | sglang
    model: str
    block_tokens: int  # vLLM block size / SGLang page size
    device_tokens: int  # the device KV cache, in tokens (a multiple of block_tokens)
    max_model_len: int
    max_batched_tokens: int  # vLLM --max-num-batched-tokens (SGLang: --chunked-prefill-size)
    dtype: str
    l1_size: str
    redis_url: str | None
    lmcache_dir: Path
    sglang_python: str | None
    start_timeout: float
    request_timeout: float
    hicache_ratio: float = 2.0  # SGLang: host pool / device pool of every HiCache configuration


class Result(NamedTuple):
    ttft_ms: float
    e2e_ms: float
    output_tokens: int
    cached: dict[str, int]  # tokens by source; "total" is every cached prompt token


@dataclass
class Endpoint:
    engine: str
    url: str
    model: str
    timeout: float
    metrics_url: str = ""  # whose /metrics tier_counts reads (default: url's; P/D: the decode instance's)

    def session(self) -> Any:
        """The aiohttp session ``send`` takes (open it in the event loop that sends)."""
        return session(self.timeout)

    def send_now(self, prompt: list[int], max_tokens: int) -> Result:
        """``send`` on an event loop of its own (the warm-up)."""
        async def go() -> Result:
            async with self.session() as http:
                return await self.send(http, prompt, max_tokens)

        return asyncio.run(go())

    async def send(self, http: Any, prompt: list[int], max_tokens: int) -> Result:
        """One greedy streamed request (EOS ignored, so every config does the same work)."""
        if self.engine == "vllm":
            path = "/v1/completions"
            body: dict[str, Any] = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                                    "temperature": 0, "ignore_eos": True, "stream": True,
                                    "return_token_ids": True,  # empty-text tokens still stream
                                    "stream_options": {"include_usage": True}}
        else:
            path = "/generate"
            body = {"input_ids": prompt, "stream": True,
                    "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": True}}
        start = time.perf_counter()
        ttft, out, cached = None, 0, {}
        async for chunk in astream(http, self.url + path, body):
            if self.engine == "vllm":
                got = any(c.get("text") or c.get("token_ids") for c in chunk.get("choices", []))
                usage = chunk.get("usage") or {}
                if usage:
                    out = usage.get("completion_tokens", out)
                    details = usage.get("prompt_tokens_details") or {}
                    cached = {"total": int(details.get("cached_tokens") or 0)}
            else:
                meta = chunk.get("meta_info") or {}
                got = bool(chunk.get("output_ids")) or meta.get("completion_tokens", 0) > 0
                out = meta.get("completion_tokens", out)
                details = meta.get("cached_tokens_details") or {}
                cached = {k: int(v) for k, v in details.items() if isinstance(v, (int, float))}
                cached["total"] = int(meta.get("cached_tokens") or 0)
            if got and ttft is None:
                ttft = (time.perf_counter() - start) * 1000
        e2e = (time.perf_counter() - start) * 1000
        if ttft is None:
            raise RuntimeError("no output token streamed")
        return Result(ttft, e2e, int(out), cached)

    def tier_counts(self) -> dict[str, float] | None:
        """Cumulative cached prompt tokens per source (vLLM); empty for SGLang; None when the
        server cannot be asked (it died: its requests already count as errors)."""
        if self.engine != "vllm":
            return {}
        text = self.scrape()
        return None if text is None else cached_by_source(text)

    def scrape(self) -> str | None:
        """vLLM's ``/metrics``; None for SGLang (kvstrata's series are vLLM's) or a dead server."""
        if self.engine != "vllm":
            return None
        try:
            return request("GET", (self.metrics_url or self.url) + "/metrics", timeout=30).decode()
        except OSError:
            return None


def strata_yaml(path: Path, s: Settings, folder: Path, remote: str | None, verify: float = 0.0) -> Path:
    """kvstrata's YAML: CPU tier, disk or (``remote``) shared tier, ``verify.sample_rate`` (even 0)."""
    lines = ["verify:", f"  sample_rate: {verify:g}", "l1:", f"  size: {s.l1_size}", "l2:"]
    if remote:  # the shared tier stands in for the disk tier
        lines += ["  enabled: false", "remote:", "  enabled: true", "  backend: redis", f"  url: {remote}"]
    else:
        lines += [f"  path: {folder / 'l2'}"]
    path.write_text("\n".join(lines) + "\n")
    return path


@contextlib.contextmanager
def _lmcache_server(s: Settings, folder: Path, env: dict[str, str]) -> Iterator[int]:
    """LMCache's own server (multiprocess mode, CPU tier the size of kvstrata's L1)."""
    ttft.ensure_lmcache(s.lmcache_dir)
    port = free_port()
    gib = max(1, round(_bytes(s.l1_size) / (1 << 30)))
    cmd = [sys.executable, "-c", ttft.LMCACHE_MAIN, "server", "--host", "localhost", "--port", str(port),
           "--chunk-size", str(LMCACHE_CHUNK), "--l1-size-gb", str(gib), "--eviction-policy", "LRU",
           "--supported-transfer-mode", "auto"]
    with open(folder / "lmcache-server.log", "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, **env}, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not listening(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"lmcache server not listening (exit code {proc.poll()}); "
                                   f"see {folder / 'lmcache-server.log'}")
            time.sleep(0.5)
        yield port
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
        proc.wait()


DISAGG_TIMEOUT_MS = 2000  # the shared tier's call timeout in the P/D pair's YAML (default 200)
LMCACHE_CHUNK = 256  # LMCache's default chunk; see README of the bench for why not the block size


def _bytes(size: str) -> int:
    from kvstrata.config import parse_size

    return parse_size(size)


def common_env(s: Settings) -> dict[str, str]:
    """The environment every server of a bench gets (vLLM's CPU settings, telemetry off)."""
    return {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
            "LMCACHE_TRACK_USAGE": "false"}


@contextlib.contextmanager
def launch(s: Settings, config: str, folder: Path) -> Iterator[Endpoint]:
    """A healthy server for ``config`` with its stores under ``folder``; stopped on exit."""
    folder.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        if s.engine == "vllm":
            yield _vllm(s, config, folder, stack)
        else:
            yield _sglang(s, config, folder, stack)


def vllm_flags(s: Settings) -> list[str]:
    """The flags every vLLM server of a bench gets beside the model, port and block size."""
    return ["--num-gpu-blocks-override", str(s.device_tokens // s.block_tokens),
            "--max-model-len", str(s.max_model_len), "--max-num-batched-tokens", str(s.max_batched_tokens),
            "--dtype", s.dtype, "--seed", "0"]


def _vllm(s: Settings, config: str, folder: Path, stack: contextlib.ExitStack) -> Endpoint:
    if config == "disagg":  # two servers and a router (its figures: serve_disagg.py)
        return _disagg(s, folder, stack)
    env = common_env(s)
    kv: dict[str, Any] | None = None
    if config in STRATA_L1L2:
        kv = ttft.strata_transfer_config(strata_yaml(folder / "kvstrata.yaml", s, folder, None, STRATA_L1L2[config]))
    elif config == "strata-remote":
        url = stack.enter_context(redis_server(s.redis_url, folder / "redis"))
        kv = ttft.strata_transfer_config(strata_yaml(folder / "kvstrata.yaml", s, folder, url))
    elif config == "peer":
        kv = ttft.example_transfer_config(folder / "peer")
    elif config == "lmcache":
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(s.lmcache_dir), os.environ.get("PYTHONPATH")]))
        kv = ttft.lmcache_transfer_config(stack.enter_context(_lmcache_server(s, folder, env)))
    elif config != "baseline":
        raise ValueError(f"config {config!r} is not available with vLLM")
    port = free_port()
    cmd = vllm_command(s.model, port, kv, block_size=s.block_tokens, extra=vllm_flags(s))
    stack.enter_context(Server(cmd, folder / "server.log", port, env=env, timeout=s.start_timeout))
    return Endpoint("vllm", f"http://127.0.0.1:{port}", s.model, s.request_timeout)


def _disagg(s: Settings, folder: Path, stack: contextlib.ExitStack) -> Endpoint:
    """``disagg``: Redis, a ``kv_producer`` and a ``kv_consumer`` server (each with every other
    setting of the bench's servers: block size, device KV cache, batch size, kvstrata's CPU tier,
    no disk tier, as ``strata-remote``) and the router in front of them; all stopped by ``stack``.
    The shared tier's calls get ``DISAGG_TIMEOUT_MS``: a decode leg reads a whole prompt from it in
    one batch, tens of MB for a long prompt of a real model."""
    url = stack.enter_context(redis_server(s.redis_url, folder / "redis"))
    servers = []
    for role in ("kv_producer", "kv_consumer"):
        yaml = strata_yaml(folder / f"{role}.yaml", s, folder, url)
        yaml.write_text(yaml.read_text().replace("remote:\n", f"remote:\n  timeout_ms: {DISAGG_TIMEOUT_MS}\n"))
        kv = {**ttft.strata_transfer_config(yaml), "kv_role": role}
        port = free_port()
        servers.append(Server(vllm_command(s.model, port, kv, block_size=s.block_tokens, extra=vllm_flags(s)),
                              folder / f"{role}.log", port, env=common_env(s), timeout=s.start_timeout))
    for server in servers:  # one after the other: two engines starting at once on a small CPU time
        stack.enter_context(server)  # out the shared tier's calls, and its breaker drops the first saves
    prefill, decode = servers
    port = free_port()
    stack.enter_context(Server([sys.executable, "-m", "kvstrata.tools.pd_router", "--port", str(port), "--prefill",
                                prefill.url, "--decode", decode.url, "--timeout", str(s.request_timeout)],
                               folder / "router.log", port, timeout=60, kind=None))
    return Endpoint("vllm", f"http://127.0.0.1:{port}", s.model, s.request_timeout, metrics_url=decode.url)


def _sglang(s: Settings, config: str, folder: Path, stack: contextlib.ExitStack) -> Endpoint:
    from tests.harness import sglang_server as sg

    python = sg.find_python(s.sglang_python)
    cuda = sg.python_has_cuda(python)
    env = common_env(s)
    if not cuda:
        env.update(sg.cpu_env(sg.ROOT / ".cache" / "sglang"))
    args = ["--model-path", s.model, "--page-size", str(s.block_tokens), "--context-length",
            str(s.max_model_len), "--chunked-prefill-size",  # SGLang wants whole pages
            str(-(-s.max_batched_tokens // s.block_tokens) * s.block_tokens),
            "--dtype", s.dtype, "--random-seed", "0"]
    args += sg.cpu_flags(s.device_tokens) if not cuda else ["--max-total-tokens", str(s.device_tokens)]
    if config != "baseline":
        args += ["--enable-hierarchical-cache", "--hicache-ratio", f"{s.hicache_ratio:g}",
                 "--hicache-storage-prefetch-policy", "wait_complete"]
    if config in STRATA_L1L2 or config == "strata-remote":
        url = stack.enter_context(redis_server(s.redis_url, folder / "redis")) if config == "strata-remote" else None
        kvstrata = strata_yaml(folder / "kvstrata.yaml", s, folder, url, STRATA_L1L2.get(config, 0.0))
        plugin = {"backend_name": "kvstrata", "module_path": "kvstrata.adapters.sglang",
                  "class_name": "StrataStorage", "interface_v1": 1,
                  "config_file": str(kvstrata)}
        (folder / "sglang.json").write_text(json.dumps(plugin))
        args += ["--hicache-storage-backend", "dynamic", "--hicache-storage-backend-extra-config",
                 f"@{folder / 'sglang.json'}"]
    elif config == "peer":
        env["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = str(folder / "peer")
        args += ["--hicache-storage-backend", "file"]
    elif config not in ("baseline", "hicache"):
        raise ValueError(f"config {config!r} is not available with SGLang")
    server = stack.enter_context(sg.SGLangServer(python, args, folder / "server.log", env,
                                                 start_timeout=s.start_timeout,
                                                 request_timeout=s.request_timeout))
    return Endpoint("sglang", server.url, s.model, s.request_timeout)
