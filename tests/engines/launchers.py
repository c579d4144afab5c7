"""The launchers of the engine tests (tests/engines/: a real vLLM or SGLang engine on CPU, the tiny
local model) and what the tests say to them; tests/engines/conftest.py wraps them in fixtures.

- ``tiny_model``: the tiny random-weight model, built once per checkout (under ``.cache/models/``,
  keyed by the builder script's hash); the ``model`` fixture is it, once per session at most.
- ``StepEngine``: the one launcher of offline vLLM engines (``vllm_steps.py``: ``vllm.LLM`` in
  its own process, kept up between lists of steps, its store's counters readable); the
  ``vllm_engine`` fixture is a factory of engines that end with the test. Engines are forked from
  a zygote (zygote.py: vLLM imported once per test worker), unless ``prefix`` wraps the script
  or ``KVSTRATA_TEST_ZYGOTE=0``.
- ``VllmServer``: the one launcher of vLLM's OpenAI server (``kvstrata.tools.serving.Server``
  with a completion helper); the ``vllm_server`` fixture is a factory. For example::

      def test_x(vllm_server, model, tmp_path):
          server = vllm_server(config_yaml, env={"KEY": "value"}, extra=["--max-num-seqs", "4"])
          done = server.complete(prompt_ids, max_tokens=8, salt="t1")  # .tokens, .cached_tokens
          server.reset_prefix_cache()                # vLLM's own cache
          server.reset_prefix_cache(connector=True)  # and kvstrata's (a new epoch)
          server.metrics(); server.url; server.tail()
          server.stop()                              # else stopped when the test ends

  ``start_vllm_server(model, log_dir, config)`` is the same outside a function-scoped fixture
  (a module fixture that shares one server: call ``.stop()`` at its teardown).
- ``new_sglang_server``: the one launcher of SGLang servers (``tests.harness.sglang_server``'s
  ``SGLangServer`` with the tests' CPU flags; ``sglang_generate`` reads what it served from where),
  and ``SGLangServers``, at most one running at a time; the ``sglang_server`` and
  ``sglang_servers`` fixtures wrap them.
- ``Baselines``: greedy outputs of vLLM with no connector, computed once per session by one engine
  and cached by (model, prompt, max_tokens, dtype); the ``baseline`` fixture: ``baseline(prompt_ids)``.
- ``run_command``: a kvstrata command the tests run (its engines stopped on a timeout).

Sharing engines: a test that needs no start-up or restart of its own uses a shared engine and
isolates itself with a fresh ``cache_salt`` (its own keys, the same outputs), or with a reset
of the prefix cache; counters are compared before and after (``delta``).

Every engine start (these launchers', and those of the kvstrata commands the tests run) is
counted through ``$KVSTRATA_ENGINE_STARTS`` (``tests.harness.starts``); tests/conftest.py prints the
count at the end of the session.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Sequence

import pytest

from kvstrata.tools import serving
from tests.harness.sglang_server import SGLangServer, cpu_env, cpu_flags, find_python
from tests.harness.trials import environment as trials_environment

from .zygote import Zygote

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
STEPS = HERE / "vllm_steps.py"
BUILDER = ROOT / "examples" / "make_tiny_model.py"
BS = 32  # vLLM block size of the engine tests
PAGE = 16  # SGLang page size of the engine tests


def ids(seed: int, n: int) -> list[int]:
    """``n`` token ids from a seeded generator (the tiny model's vocabulary is 3,072)."""
    rng = random.Random(seed)
    return [rng.randrange(10, 3000) for _ in range(n)]


LONG = ids(1, 500)  # 15 full blocks and a 20-token tail
SHARED = ids(2, 300)
FORK_A = SHARED + ids(3, 120)
FORK_B = SHARED + ids(4, 140)


def gen(prompt: list[int], **kw: Any) -> dict:
    """A ``generate`` step of ``StepEngine.run``."""
    return {"op": "generate", "prompt": prompt, **kw}


def salt() -> str:
    """A fresh cache salt: keys no other request has, the same outputs."""
    return os.urandom(8).hex()


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    """Counters that grew between two ``counters`` steps, by how much."""
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


# ------------------------------------------------------------------------- kvstrata commands
def run_command(args: list[str], timeout: float, **kw: Any) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(args, capture_output=True, text=True)``, but past ``timeout`` the command
    gets SIGINT first (a kvstrata command then stops the engines it started, each in a session of
    its own) and SIGKILL only 60 s later; the test then fails with what it printed. A kvstrata
    module run with ``-m`` runs under ``tests.harness.counted``, so its engines are counted."""
    if args[1:2] == ["-m"] and args[2].startswith("kvstrata."):
        args = [args[0], "-m", "tests.harness.counted", *args[2:]]
    with subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)
            try:
                out, err = proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
            pytest.fail(f"{' '.join(args[:6])} ... did not finish within {timeout:.0f} s:\n{out[-3000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


# ----------------------------------------------------------------------------------- model
def tiny_model(preset: str = "tiny") -> str:
    """A preset's model folder (examples/make_tiny_model.py), built if missing:
    ``.cache/models/<preset>-<builder hash>``, so a change of the builder makes a new one and an
    unchanged builder reuses it across runs."""
    digest = hashlib.sha1(BUILDER.read_bytes()).hexdigest()[:12]
    out = ROOT / ".cache" / "models" / f"{preset}-{digest}"
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / ".build.lock", "w") as lock:  # one build when test workers start together
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "config.json").exists():  # the builder renames a complete folder into place
            subprocess.run([sys.executable, str(BUILDER), str(out), "--preset", preset], check=True, timeout=600)
    return str(out)


# ------------------------------------------------------------------------ offline vLLM engine
class EngineFailed(AssertionError):
    pass


def unsampled(config: Path | None) -> Path | None:
    """``config``, or where it names no ``verify`` section a copy beside it with
    ``verify.sample_rate: 0``: the suite's engines verify no hit unless a test asks (at the default
    0.001 one request in a thousand would lose its hit, and a test asserting that hit would fail
    once in a few runs). Tests of verified hits set ``verify`` themselves."""
    if config is None:
        return None
    text = Path(config).read_text()
    if "verify" in text:
        return config
    if text.lstrip().startswith("{"):  # a JSON config
        text = json.dumps({**json.loads(text), "verify": {"sample_rate": 0}})
    else:
        text = text.rstrip("\n") + "\nverify:\n  sample_rate: 0\n"
    out = Path(config).with_name(Path(config).name + ".unsampled.yaml")
    out.write_text(text)
    return out


class StepEngine:
    """One offline vLLM engine (``vllm_steps.py``) in a process group of its own, launched at once.

    ``run(steps)`` sends a list of steps and returns their results (waiting for the engine to be
    up first); call it any number of times. ``wait_ready()`` returns the seconds from launch to
    serving; ``wait_failed()`` expects a failed start and returns the log. ``close()`` ends it
    (stdin closed, then the group killed); so does leaving a ``with`` block.

    ``prefix`` goes between the interpreter and the script (``["-c", CODE, args...]`` runs
    ``CODE`` that then runs the script with ``runpy``)."""

    def __init__(self, model: str, log_dir: Path, config: Path | None = None, *, name: str = "engine",
                 mp: bool = False, tp: int = 1, module_path: bool = True, dtype: str = "auto",
                 env: dict[str, str] | None = None, prefix: Sequence[str] = (), block_size: int = BS,
                 speculative: dict[str, Any] | None = None, pp: int = 1,
                 compilation: dict[str, Any] | None = None, **options: Any) -> None:
        """``options``: more keys of vllm_steps.py's SPEC (``lora``, ``prompt_embeds``, ``hf_overrides``,
        ``quantization``, ``max_model_len``; ``trials``: test-only behaviour planted into every process of
        the engine, tests/harness/trials.py)."""
        log_dir.mkdir(parents=True, exist_ok=True)
        tag = f"{name}-{os.urandom(3).hex()}"
        spec = log_dir / f"{tag}.json"
        run_config = unsampled(config)
        spec.write_text(json.dumps({"model": model, "config": str(run_config) if run_config else None, "mp": mp, "tp": tp,
                                    "block_size": block_size, "module_path": module_path, "dtype": dtype,
                                    "speculative": speculative, "pp": pp, "compilation": compilation,
                                    **options}))
        self.log_path = log_dir / f"{tag}.log"
        self.config, self.name = config, name
        self._log = open(self.log_path, "w")
        self._lines: queue.Queue[str | None] = queue.Queue()
        self.started = time.monotonic()
        self.ready_s: float | None = None
        # Test-only trials reach every process of the engine: its EngineCore and workers are spawned.
        environ = {**os.environ, **(trials_environment(options["trials"]) if options.get("trials") else {}),
                   **(env or {})}
        if prefix or os.environ.get("KVSTRATA_TEST_ZYGOTE") == "0":
            self.proc: Any = subprocess.Popen([sys.executable, *prefix, str(STEPS), str(spec)], stdin=subprocess.PIPE,
                                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                                              env=environ, start_new_session=True)
        else:  # forked from a process that has imported vLLM already: the same run, ~10 s sooner
            self.proc = _zygote().spawn([str(STEPS), str(spec)], environ, ROOT)
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(("READY", "RESULT ", "ERROR ")):
                self._lines.put(line.rstrip("\n"))
            else:
                self._log.write(line)
                self._log.flush()
        self._lines.put(None)

    def tail(self, n: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def _next(self, timeout: float) -> str:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            self.kill()
            raise EngineFailed(f"{self.name}: no answer within {timeout:.0f} s:\n{self.tail()}") from None
        if line is None:
            self.proc.wait(timeout=60)
            raise EngineFailed(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")
        return line

    def wait_ready(self, timeout: float = 600) -> float:
        if self.ready_s is None:
            left = timeout - (time.monotonic() - self.started)
            line = self._next(max(left, 1))
            assert line == "READY", line
            self.ready_s = time.monotonic() - self.started
        return self.ready_s

    def wait_failed(self, timeout: float = 600) -> str:
        """For a start that must fail: the log, once the process has exited non-zero."""
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise EngineFailed(f"{self.name} kept running:\n{self.tail()}") from None
        assert rc != 0, f"{self.name} exited 0:\n{self.tail()}"
        time.sleep(0.2)  # the pump's last lines
        return self.log_path.read_text(errors="replace")

    def run(self, steps: list[dict], timeout: float = 600) -> list[dict]:
        self.send(steps)
        return self.receive(timeout)

    def send(self, steps: list[dict]) -> None:
        """``run``'s first half: the steps go, the answer is ``receive``'s (a test that acts on the
        engine's processes while it runs them)."""
        self.wait_ready()
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(steps) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # reported by _next

    def receive(self, timeout: float = 600) -> list[dict]:
        line = self._next(timeout)
        if line.startswith("ERROR "):
            raise EngineFailed(f"{self.name}: a step failed:\n{json.loads(line[6:])}")
        return json.loads(line[len("RESULT "):])

    def counters(self) -> dict[str, int]:
        return self.run([{"op": "counters"}])[0]

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=60)

    def close(self, timeout: float = 30) -> None:
        """A clean stop (the connector writes out queued saves) within ``timeout`` s, else killed."""
        if self.proc.poll() is None and timeout > 0:
            with contextlib.suppress(OSError):
                assert self.proc.stdin is not None
                self.proc.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=timeout)
        self.kill()  # whatever of its group is left (EngineCore, TP workers)
        self._log.close()

    def __enter__(self) -> "StepEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_ZYGOTE: list[Zygote] = []


def _zygote() -> Zygote:
    """This test worker's zygote (zygote.py), started on first use; it ends when the worker does."""
    if not _ZYGOTE:
        import atexit
        import shutil
        import tempfile

        zygote = Zygote(Path(tempfile.mkdtemp(prefix="kvstrata-zygote-")))
        atexit.register(shutil.rmtree, zygote.folder, True)
        atexit.register(zygote.close)
        _ZYGOTE.append(zygote)
    return _ZYGOTE[0]


def run_once(model: str, log_dir: Path, config: Path | None, steps: list[dict], **kw: Any) -> list[dict]:
    """A fresh engine for one list of steps (a test about a start of its own)."""
    with StepEngine(model, log_dir, config, **kw) as engine:
        return engine.run(steps)


def disk_config(folder: Path, name: str = "kvstrata.yaml", l2: Path | None = None, **sections: str) -> Path:
    """``folder/name``: L1 of 128 MiB, L2 at ``l2`` (default ``folder/l2``), and raw YAML lines."""
    path = folder / name
    lines = ["l1:", "  size: 128MiB", "l2:", f"  path: {l2 or folder / 'l2'}"]
    lines += [f"{k}: {v}" for k, v in sections.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


class Baselines:
    """Greedy outputs of vLLM alone (no connector), one engine per (model, dtype), cached: in
    memory, and as files in the folder ``$KVSTRATA_TEST_BASELINES`` names, which every test worker
    of the session reads, so an output one worker computed starts no engine on the other."""

    def __init__(self, log_dir: Path, model: str, shared: Path | None = None) -> None:
        self.log_dir, self.model, self.shared = log_dir, model, shared
        self._engines: dict[tuple, StepEngine] = {}
        self._cache: dict[tuple, list[int]] = {}

    def _file(self, key: tuple) -> Path | None:
        if self.shared is None:
            return None
        return self.shared / (hashlib.sha1(json.dumps(key).encode()).hexdigest() + ".json")

    def _known(self, key: tuple) -> bool:
        if key not in self._cache and (path := self._file(key)) is not None and path.exists():
            self._cache[key] = json.loads(path.read_text())
        return key in self._cache

    def _keep(self, key: tuple, tokens: list[int]) -> None:
        self._cache[key] = tokens
        if (path := self._file(key)) is not None:
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(tokens))
            tmp.rename(path)  # whole or absent for the other worker

    def __call__(self, prompt: list[int], max_tokens: int = 8, *, model: str | None = None,
                 dtype: str = "auto", block_size: int = BS) -> list[int]:
        return self.many([prompt], max_tokens, model=model, dtype=dtype, block_size=block_size)[0]

    def many(self, prompts: list[list[int]], max_tokens: int = 8, *, model: str | None = None,
             dtype: str = "auto", block_size: int = BS) -> list[list[int]]:
        model = model or self.model
        at = self._settings(model, dtype, block_size)
        keys = [(*at, max_tokens, tuple(p)) for p in prompts]
        todo = [(p, k) for p, k in zip(prompts, keys) if not self._known(k)]
        if todo:
            out = self.engine(model, dtype, block_size).run([gen(p, max_tokens=max_tokens) for p, _ in todo])
            for (_, key), r in zip(todo, out):
                self._keep(key, r["tokens"])
            if model != self.model:  # another model (a test's own copy): not needed again
                self._engines.pop(at).close()
        return [self._cache[k] for k in keys]

    @staticmethod
    def _settings(model: str, dtype: str, block_size: int) -> tuple:
        return (model, dtype) if block_size == BS else (model, dtype, block_size)

    def engine(self, model: str, dtype: str = "auto", block_size: int = BS) -> StepEngine:
        """The no-connector engine of these settings (started on first use; for another model than
        the session's, closed once ``many`` has used it)."""
        at = self._settings(model, dtype, block_size)
        if at not in self._engines:
            self._engines[at] = StepEngine(model, self.log_dir, None, name="baseline", dtype=dtype,
                                           block_size=block_size)
        return self._engines[at]

    def close(self) -> None:
        for engine in self._engines.values():
            engine.close()
        self._engines.clear()


# ----------------------------------------------------------------------------- vLLM server
class VllmServer(serving.Server):
    """vLLM's OpenAI server (``serving.Server``) with kvstrata on ``config`` (None: no connector),
    on a free loopback port, with POST /reset_prefix_cache enabled. ``start()`` waits for /health."""

    def __init__(self, model: str, log_path: Path, config: Path | None = None, *, env: dict[str, str] | None = None,
                 extra: list[str] | None = None, block_size: int = BS, timeout: float = 600) -> None:
        port = serving.free_port()
        kv = serving.strata_transfer_config(str(unsampled(config))) if config else None
        super().__init__(serving.vllm_command(model, port, kv, block_size=block_size, extra=extra), log_path, port,
                         env={"VLLM_SERVER_DEV_MODE": "1", **(env or {})}, timeout=timeout)
        self.model = model
        self._running = False

    def start(self) -> "VllmServer":
        self.__enter__()
        self._running = True
        return self

    def stop(self) -> None:
        if self._running:
            self._running = False
            self.__exit__()

    def complete(self, prompt: list[int], max_tokens: int = 8, salt: str | None = None) -> serving.Completion:
        return serving.complete(self, self.model, prompt, max_tokens=max_tokens, cache_salt=salt)

    def reset_prefix_cache(self, connector: bool = False) -> None:
        """vLLM's own prefix cache; with ``connector``, kvstrata's too (a new epoch)."""
        self.post("/reset_prefix_cache" + ("?reset_external=true" if connector else ""))


def start_vllm_server(model: str, log_dir: Path, config: Path | None = None, **kw: Any) -> VllmServer:
    log_dir.mkdir(parents=True, exist_ok=True)
    return VllmServer(model, log_dir / f"vllm-{os.urandom(3).hex()}.log", config, **kw).start()


# ---------------------------------------------------------------------------- SGLang server
SGLANG_START_TIMEOUT = 480  # 2 cores shared with the other test worker
SGLANG_REQUEST_TIMEOUT = 180


def sglang_python() -> str | None:
    try:
        return find_python()
    except RuntimeError:
        return None


needs_sglang = pytest.mark.skipif(sglang_python() is None, reason="no SGLang environment (run scripts/setup_sglang.sh)")


def sglang_config(path: Path, l2: Path, *, v1: bool = True, **extra: Any) -> Path:
    """The backend's YAML (written as JSON, which is YAML): SGLang's plugin keys and kvstrata's."""
    cfg = {"backend_name": "kvstrata", "module_path": "kvstrata.adapters.sglang",
           "class_name": "StrataStorage", "interface_v1": int(v1),
           "hicache_storage_pass_prefix_keys": True,  # passed, and ignored: see StrataStorage
           "l1": {"size": "256MiB"}, "l2": {"path": str(l2)},
           "verify": {"sample_rate": 0},  # no hit verified unless a test asks (``unsampled``)
           **extra}
    path.write_text(json.dumps(cfg))
    return path


def sglang_args(model: str, config: Path | None, layout: str = "layer_first", metrics: bool = False) -> list[str]:
    """The tests' server: page 16, HiCache (ratio 2) with kvstrata as its storage backend."""
    args = ["--model-path", model, *cpu_flags(8192), "--page-size", str(PAGE),
            "--enable-hierarchical-cache", "--hicache-ratio", "2",
            "--hicache-storage-prefetch-policy", "wait_complete"]
    if layout != "layer_first":  # the shims copy page_first with the "kernel" backend
        args[args.index("--hicache-mem-layout") + 1] = layout
        args[args.index("--hicache-io-backend") + 1] = "kernel"
    if config is not None:
        args += ["--hicache-storage-backend", "dynamic", "--hicache-storage-backend-extra-config", f"@{config}"]
    return args + (["--enable-metrics"] if metrics else [])


def new_sglang_server(model: str, config: Path | None, log_path: Path, *, layout: str = "layer_first",
                      metrics: bool = False) -> SGLangServer:
    """Not started yet: ``with`` it, or call ``__enter__`` (``SGLangUnavailable`` if it fails)."""
    python = sglang_python()
    if python is None:
        pytest.skip("no SGLang environment (run scripts/setup_sglang.sh)")
    return SGLangServer(python, sglang_args(model, config, layout, metrics), log_path,
                        cpu_env(ROOT / ".cache" / "sglang"), start_timeout=SGLANG_START_TIMEOUT,
                        request_timeout=SGLANG_REQUEST_TIMEOUT)


class SGLangServers:
    """At most one running SGLang server (2 cores): ``get(config)`` gives the running one when it
    has that config, layout and metrics flag, else stops it and starts one; ``fresh=True`` always
    starts one. ``sglang_servers`` is the session's (tests of several modules share a server)."""

    def __init__(self, model: str, log_dir: Path) -> None:
        self.model, self.log_dir = model, log_dir
        self.current: SGLangServer | None = None
        self._key: tuple[Path, str, bool] | None = None

    def get(self, config: Path, *, layout: str = "layer_first", fresh: bool = False,
            metrics: bool = False) -> SGLangServer:
        running, key = self.current, (config, layout, metrics)
        if running is not None and self._key == key and not fresh and running.proc.poll() is None:
            return running
        self.stop()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        server = new_sglang_server(self.model, config, self.log_dir / f"sglang-{os.urandom(3).hex()}.log",
                                   layout=layout, metrics=metrics)
        self.current, self._key = server, key
        return server.__enter__()

    def stop(self) -> None:
        if self.current is not None:
            self.current.stop()
            self.current, self._key = None, None


# Run in SGLang's environment by ``sglang_probe``, before the probe's own lines: the shims' import
# hook, and ``outcome`` (a call's "ok" or its exception as "Type: message") and ``argv`` for them.
SGLANG_PROBE = """
import json, sys
import sglang_cpu_hook
sglang_cpu_hook.install()
import torch
from sglang.srt.server_args import prepare_server_args

def outcome(call):
    try:
        call()
        return "ok"
    except BaseException as e:
        return f"{type(e).__name__}: {e}"

argv = json.loads(sys.argv[1])
"""


def sglang_probe(code: str, argv: list[str], **env: str) -> dict[str, str]:
    """``code`` (after ``SGLANG_PROBE``) in SGLang's environment with the CPU shims, no server:
    what it prints as ``RESULT <json>``."""
    out = subprocess.run([sglang_python(), "-c", SGLANG_PROBE + code, json.dumps(argv)], capture_output=True,
                         text=True, env={**os.environ, **cpu_env(ROOT / ".cache" / "sglang"), **env}, cwd=ROOT,
                         timeout=300)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"exit {out.returncode}:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def sglang_generate(server: SGLangServer, prompt: list[int], **extra: Any) -> dict:
    """Greedy 8 tokens; the prompt tokens served from storage, device and host."""
    out = server.generate(prompt, 8, **extra)
    return {"tokens": out.tokens, "storage": out.cached.get("storage", 0), "device": out.cached.get("device", 0),
            "host": out.cached.get("host", 0)}


def sglang_log(server: SGLangServer) -> str:
    return server.log_path.read_text(errors="replace")


__all__ = ["BS", "FORK_A", "FORK_B", "LONG", "PAGE", "SHARED", "Baselines", "EngineFailed", "StepEngine",
           "SGLangServers", "SGLANG_PROBE", "VllmServer", "delta", "disk_config", "gen", "ids", "needs_sglang", "new_sglang_server", "run_command", "run_once",
           "salt", "sglang_config", "sglang_generate", "sglang_log", "sglang_probe", "start_vllm_server", "tiny_model"]
