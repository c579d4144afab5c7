"""Test-only behaviour planted into kvstrata, never a setting: a slow disk, a slow load copy, and
an identity hole that the identity work closed. None of it is in kvstrata's configuration (a
YAML that names the old ``testing:`` section is refused); a test plants it in its own process
(``plant``, or pytest's ``monkeypatch`` through ``planted``), and an engine the tests or the
benchmarks start gets it in every process through ``environment``: ``trials_site/sitecustomize.py``
on its ``PYTHONPATH`` plants ``$KVSTRATA_TRIALS`` at interpreter start (vLLM's CPU platform
spawns its EngineCore and workers), and ``tests/engines/vllm_steps.py`` plants its spec's
``"trials"`` in its own process, which the test zygote forks. Each planted trial is logged at
WARNING, once per process. (A narrower index key, which forces collisions that
validation must reject, is ``BlockStore(config, key_bits=16)``: a Python argument, never a setting.)

Trials:

- ``l2_write_delay_ms``: every disk-tier block write sleeps this long first (a disk that cannot
  keep up with the saves);
- ``load_delay_s``: every vLLM worker sleeps this long in each step with loads, after the
  scheduler pinned the slots and before the copy out of them (a copy that outlasts any lease:
  tests/engines/test_vllm_pins.py);
- ``identity_hole: lora_version``: a LoRA adapter is keyed by its name and path alone, as before
  adapters were keyed by content: an adapter rewritten in place then serves its old KV (the
  verified-hits tests catch it).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger("kvstrata.trials")
ENV = "KVSTRATA_TRIALS"  # JSON: name -> value; read only by trials_site/sitecustomize.py
SITE = Path(__file__).resolve().parent / "trials_site"
ROOT = Path(__file__).resolve().parents[2]
_planted: dict[str, Any] = {}  # this process's trials (planted once each)

Setter = Callable[[Any, str, Any], None]  # setattr, or pytest's monkeypatch.setattr


def _slow_disk(ms: float, set_: Setter) -> None:
    from kvstrata.tiers.disk import DiskTier

    write_views = DiskTier.write_views
    said: list[int] = []

    @functools.wraps(write_views)
    def slow(self, meta, parts):  # type: ignore[no-untyped-def]
        if not said:  # once per process: the log shows the trial reached the process that writes
            said.append(1)
            log.warning("kvstrata test trial: disk writes slowed by %s ms in this process", ms)
        time.sleep(ms / 1000)
        return write_views(self, meta, parts)

    set_(DiskTier, "write_views", slow)


def _slow_load(seconds: float, set_: Setter) -> None:
    from kvstrata.adapters.vllm.worker import WorkerSide

    start_load_kv = WorkerSide.start_load_kv

    @functools.wraps(start_load_kv)
    def slow(self, meta):  # type: ignore[no-untyped-def]
        if meta.loads:
            self._attach(meta.arena)  # the first step's mapping first, as the real call does
            time.sleep(seconds)
        return start_load_kv(self, meta)

    set_(WorkerSide, "start_load_kv", slow)


def _identity_hole(kind: str, set_: Setter) -> None:
    if kind != "lora_version":
        raise ValueError(f"unknown identity hole {kind!r}")
    from kvstrata.adapter_versions import AdapterVersions

    version = AdapterVersions.version

    def by_name_and_path(self, adapter_id, path, *, reloaded=False):  # type: ignore[no-untyped-def]
        # Files changed under the engine are still refused, as before; only the content leaves the key.
        return None if version(self, adapter_id, path, reloaded=reloaded) is None else ""

    set_(AdapterVersions, "version", by_name_and_path)


TRIALS: dict[str, Callable[[Any, Setter], None]] = {
    "l2_write_delay_ms": _slow_disk,
    "load_delay_s": _slow_load,
    "identity_hole": _identity_hole,
}


def plant(trials: dict[str, Any] | None, set_: Setter = setattr) -> None:
    """Plant ``trials`` (name -> value) into this process's kvstrata, each once per process."""
    for name, value in (trials or {}).items():
        if _planted.get(name, object()) == value and set_ is setattr:
            continue
        TRIALS[name](value, set_)
        if set_ is setattr:
            _planted[name] = value
        log.warning("kvstrata test trial planted: %s = %r (test-only, never in a deployment)", name, value)


def planted(monkeypatch: Any, **trials: Any) -> None:
    """``plant`` through pytest's ``monkeypatch``: undone when the test ends."""
    plant(trials, monkeypatch.setattr)


def environment(trials: dict[str, Any]) -> dict[str, str]:
    """The environment of an engine process that plants ``trials`` in itself and in every process
    it starts (``PYTHONPATH``: the site folder and the repository root before the caller's)."""
    path = os.pathsep.join(filter(None, [str(SITE), str(ROOT), os.environ.get("PYTHONPATH")]))
    return {"PYTHONPATH": path, ENV: json.dumps(trials)}
