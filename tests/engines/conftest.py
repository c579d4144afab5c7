"""The engine layer of the tests: everything under tests/engines/ runs a real vLLM or SGLang engine
(CPU, the tiny local model) and is marked ``engine`` here, so ``pytest -m "not engine"`` runs the
unit layer alone. This file holds the fixtures those tests share, over the launchers of
launchers.py (which says what each one does):

- ``model``: the tiny random-weight model (``tiny_model``), built once per session at most.
- ``vllm_engine``: a factory of offline vLLM engines (``StepEngine``) that end with the test;
  ``disk_pair``: two engines of a module on one L2 folder.
- ``vllm_server``: a factory of vLLM OpenAI servers (``VllmServer``) stopped with the test.
- ``sglang_server``: a factory of SGLang servers stopped with the test; ``sglang_servers``: the
  session's one running SGLang server (``SGLangServers``); ``sglang_direct_config``.
- ``baseline``: greedy outputs of vLLM with no connector (``Baselines``), shared by the session's
  test workers through the folder ``$KVSTRATA_TEST_BASELINES`` names.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from tests.builders import BASELINES_ENV  # a folder the session's workers share (tests/conftest.py)
from tests.harness.sglang_server import SGLangServer

from .launchers import (Baselines, SGLangServers, StepEngine, VllmServer, disk_config, new_sglang_server,
                        sglang_config, start_vllm_server, tiny_model)

HERE = Path(__file__).resolve().parent


# ----------------------------------------------------------------------------------- marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.engine)


# ----------------------------------------------------------------------------------- model
@pytest.fixture(scope="session")
def model() -> str:
    return tiny_model()


# ------------------------------------------------------------------------ offline vLLM engine
@pytest.fixture
def vllm_engine(model: str, tmp_path: Path) -> Iterator[Callable[..., StepEngine]]:
    """``vllm_engine(config, **StepEngine options)``: an engine of this test's, ended with it."""
    started: list[StepEngine] = []

    def factory(config: Path | None, *, model_dir: str | None = None, **kw: Any) -> StepEngine:
        engine = StepEngine(model_dir or model, tmp_path / "engines", config, **kw)
        started.append(engine)
        return engine

    yield factory
    for engine in started:
        engine.close()


@pytest.fixture(scope="session")
def baseline(model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Baselines]:
    """``baseline(prompt)``: vLLM's greedy output without kvstrata (8 tokens unless said)."""
    shared = os.environ.get(BASELINES_ENV)
    b = Baselines(tmp_path_factory.mktemp("baseline"), model, Path(shared) if shared else None)
    yield b
    b.close()


@pytest.fixture(scope="module")
def disk_pair(model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[StepEngine, StepEngine]]:
    """Two engines of the module (test_vllm.py), up together, on one L2 folder (``a.config``'s): ``a`` finds the connector by
    its name alone (the plugin entry point) and stages disk hits inside the lookup; ``b`` names
    the module and stages every disk hit in the background (``l1.stage_inline_bytes: 0``). Tests
    isolate themselves with fresh cache salts; a prompt one stored is a disk hit for the other."""
    tmp = tmp_path_factory.mktemp("disk-pair")
    a_cfg = disk_config(tmp, "a.yaml", tmp / "l2")
    b_cfg = tmp / "b.yaml"
    b_cfg.write_text(a_cfg.read_text().replace("l1:\n", "l1:\n  stage_inline_bytes: 0\n"))
    a = StepEngine(model, tmp, a_cfg, name="pair-a", module_path=False)
    b = StepEngine(model, tmp, b_cfg, name="pair-b")
    try:
        yield a, b
    finally:
        a.close()
        b.close()


# ----------------------------------------------------------------------------- vLLM server
@pytest.fixture
def vllm_server(model: str, tmp_path: Path) -> Iterator[Callable[..., VllmServer]]:
    """``vllm_server(config, env=..., extra=[...])``: a started server, stopped with the test."""
    started: list[VllmServer] = []

    def factory(config: Path | None = None, **kw: Any) -> VllmServer:
        server = start_vllm_server(kw.pop("model_dir", model), tmp_path / "servers", config, **kw)
        started.append(server)
        return server

    yield factory
    for server in started:
        server.stop()


# ---------------------------------------------------------------------------- SGLang server
@pytest.fixture
def sglang_server(model: str, tmp_path: Path) -> Iterator[Callable[..., SGLangServer]]:
    """``sglang_server(config, layout=..., metrics=...)``: a started server, stopped with the test."""
    started: list[SGLangServer] = []

    def factory(config: Path | None, **kw: Any) -> SGLangServer:
        server = new_sglang_server(kw.pop("model_dir", model), config,
                                   tmp_path / f"sglang-{len(started)}.log", **kw)
        started.append(server)
        return server.__enter__()

    yield factory
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def sglang_servers(model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SGLangServers]:
    manager = SGLangServers(model, tmp_path_factory.mktemp("sglang"))
    yield manager
    manager.stop()


@pytest.fixture(scope="session")
def sglang_direct_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """kvstrata's L1 (4 MiB) smaller than SGLang's host pool: pages go straight between the pool
    and their files. Shared by test_sglang.py's last server test and the disk-tier metrics test
    of test_sglang_observability.py (its first), on one server with metrics on."""
    tmp = tmp_path_factory.mktemp("sglang-direct")
    return sglang_config(tmp / "direct.json", tmp / "l2", l1={"size": "4MiB"})
