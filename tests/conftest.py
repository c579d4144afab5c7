"""The fixtures and pytest hooks of the whole suite.

The fixtures wrap the builders of tests/builders.py (``make_config``, ``make_namespace``, ...;
test modules import those directly: ``from tests.builders import ...``). The hooks group tests
for pytest-xdist's workers, set the environment the tests' processes share, and count engine starts.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Mapping

import pytest

from kvstrata.config import StrataConfig
from kvstrata.keys import Namespace
from kvstrata.store import BlockStore
from tests.builders import BASELINES_ENV, make_config, make_namespace
from tests.harness.starts import STARTS_ENV, count_engine_starts


@pytest.fixture
def redis_url(tmp_path: Path):
    """A redis-server of this test's own on loopback (``redisutil.standalone``): its URL."""
    from tests.harness import redisutil

    with redisutil.standalone(tmp_path / "redis") as (url, _port, _procs):
        yield url


@pytest.fixture
def ns() -> Namespace:
    return make_namespace()


@pytest.fixture
def config_factory(tmp_path: Path):
    """``config_factory(**overrides)``: ``make_config`` bound to this test's ``tmp_path``."""
    def factory(overrides: Mapping[str, Any] | None = None, /, **kwargs: Any) -> StrataConfig:
        return make_config(tmp_path, overrides, **kwargs)
    return factory


@pytest.fixture
def store_factory(tmp_path: Path):
    """``store_factory(**overrides)``: a BlockStore on this test's folder, closed at teardown
    (``key_bits``: the index's key width, ``BlockStore``'s)."""
    opened: list[BlockStore] = []

    def factory(overrides: Mapping[str, Any] | None = None, /, *, key_bits: int = 128, **kwargs: Any) -> BlockStore:
        store = BlockStore(make_config(tmp_path, overrides, **kwargs), key_bits=key_bits)
        opened.append(store)
        return store

    yield factory
    for store in opened:
        store.close()


# ------------------------------------------------------------------ pytest-xdist work groups
# ``make test`` runs two pytest-xdist workers; a group of tests runs whole on one worker, and the
# groups go out in collection order: the long engine groups first, the unit test files after them
# as fillers. Each test file is a group (its module fixtures start once); the vLLM benchmarks are
# one (one at a time); test_sglang.py and test_sglang_observability.py are one (the last server of
# the first goes on to the second). The other SGLang files start servers of their own and are
# groups of their own: with every SGLang test in one group (11 of the 20 slowest tests, 17 server
# starts), that one worker's share was the suite's long pole. (xdist's own
# ``--dist loadgroup`` does not group under pytest 9: it renames ``item._nodeid``, which pytest 9
# no longer reports.)
SHARED_GROUPS = {"engines/test_bench_serve": "vllm-bench", "engines/test_bench_ttft": "vllm-bench",
                 "engines/test_sglang": "sglang", "engines/test_sglang_observability": "sglang"}


def work_group(nodeid: str) -> str:
    module = nodeid.split("::", 1)[0].removeprefix("tests/").removesuffix(".py")
    return SHARED_GROUPS.get(module, module)


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, absent where it is not installed
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_group(nodeid)

    config.option.loadscopereorder = False  # collection order (engines first), not the largest group first
    return GroupScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Collection order: the engine tests first, each layer in its own order. (By name, the unit
    tests' folders ``adapters/``, ``cli/``, ``config/`` would come before ``engines/``.)"""
    items.sort(key=lambda item: not item.nodeid.startswith("tests/engines/"))


# ------------------------------------------------------------------------- engine start count
# Every engine start appends a line to the file $KVSTRATA_ENGINE_STARTS names (tests/harness/starts.py):
# the tests' launchers (tests/engines/launchers.py) and the kvstrata commands the tests run. The
# session (the controller, when pytest-xdist runs workers: they inherit the variable) prints them.
TOOL_PROCESSES = ("main.py", "ttft_worker.py", "__main__.py", "kvstrata")  # a kvstrata command's own engine processes


# OpenMP threads that wait for work sleep instead of spinning. Two test workers run engines side by
# side on 2 cores, each engine with an OpenMP pool as wide as the machine, so a spinning waiter takes
# the core the other engine computes on. Measured here (test_vllm_spec.py + test_vllm_mla.py, -n 2,
# 7 engines, alternated): 66 s and 76 s passive against 90 s and 126 s with libgomp's default spin;
# one thread per engine (OMP_NUM_THREADS=1) took 108 s. No effect on what is computed. Set before the
# workers, engines and servers start: each reads it when it loads libgomp.
OMP_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}


ROOT = Path(__file__).resolve().parents[1]


def pytest_configure(config: pytest.Config) -> None:
    for name, value in OMP_ENV.items():
        os.environ.setdefault(name, value)
    # the processes the tests start import the harness (``tests.harness``) and the benchmarks as this one does
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if str(ROOT) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, paths)])
    count_engine_starts()
    if STARTS_ENV not in os.environ:  # else a child pytest: it counts into its parent's file
        fd, path = tempfile.mkstemp(prefix="kvstrata-engine-starts-")
        os.close(fd)
        os.environ[STARTS_ENV] = path
        config._kvstrata_starts = path  # type: ignore[attr-defined]
    if BASELINES_ENV not in os.environ:  # one folder for the session's workers (they inherit it)
        os.environ[BASELINES_ENV] = config._kvstrata_baselines = tempfile.mkdtemp(  # type: ignore[attr-defined]
            prefix="kvstrata-baselines-")


def pytest_unconfigure(config: pytest.Config) -> None:
    folder = getattr(config, "_kvstrata_baselines", None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    path = getattr(config, "_kvstrata_starts", None)
    if path is None:
        return
    try:
        starts = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
        os.unlink(path)
    except (OSError, ValueError):
        return
    if not starts:
        return
    kinds: dict[str, int] = {}
    for s in starts:
        kinds[s["kind"]] = kinds.get(s["kind"], 0) + 1
    tools = [s for s in starts if s.get("argv0") in TOOL_PROCESSES]
    terminalreporter.write_sep("=", f"engine starts: {len(starts)}")
    terminalreporter.write_line(", ".join(f"{n} {k}" for k, n in sorted(kinds.items())))
    terminalreporter.write_line(f"by the tests' launchers: {len(starts) - len(tools)}; inside the kvstrata "
                                f"commands the tests run (demo, bench): {len(tools)}")
    files: dict[str, int] = {}
    for s in starts:
        name = s.get("test", "").split("::", 1)[0].rsplit("/", 1)[-1].removesuffix(".py") or "?"
        files[name] = files.get(name, 0) + 1
    terminalreporter.write_line("by test file: " + ", ".join(
        f"{name} {n}" for name, n in sorted(files.items(), key=lambda kv: -kv[1])))
