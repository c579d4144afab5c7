"""Weights replaced in place (a fine-tune saved over the old files), end to end on the real engines.

Scenario: an engine with kvstrata stores a long prompt on the disk tier; the model folder's
weights are then overwritten with other values of the same shapes (same file names and sizes,
same config.json: a fine-tune saved over the old files). The next engine start on the same disk
tier must load nothing for that prompt and answer as the new weights do.

The engines start through the launchers of tests/engines/launchers.py, on a copy of the tiny model.
The opposite case (unchanged weights: another engine hits what the previous one stored) is
test_vllm.py::test_second_engine_process_hits_what_the_first_stored and
test_sglang.py::test_second_server_hits_what_the_first_stored_and_never_serves_a_corrupt_page.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from engines.launchers import BS, LONG, SGLangServers, StepEngine, disk_config, gen, ids, needs_sglang, run_once, salt, \
    sglang_config, sglang_generate, sglang_log
from engines.test_sglang import block_files, storage_share, stored
# Each test starts two or three engines one after the other: about 25 s each on an idle machine,
# two minutes when the 2 cores are shared, which the suite's 300 s per test would not cover.
pytestmark = pytest.mark.timeout(900)


@pytest.fixture
def own_model(model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private copy of the tiny model (its weights get replaced) and a private identity cache."""
    monkeypatch.setenv("KVSTRATA_CACHE_DIR", str(tmp_path / "identity-cache"))
    return Path(shutil.copytree(model, tmp_path / "model"))


def replace_weights_in_place(folder: Path) -> None:
    """Overwrite model.safetensors with every tensor's values shuffled: same names, dtypes, shapes,
    header and file size, same file (inode); only the values differ."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save

    path = folder / "model.safetensors"
    before = path.stat()
    with safe_open(str(path), "pt") as f:
        metadata = f.metadata()
    gen = torch.Generator().manual_seed(1)
    tensors = {name: t.flatten()[torch.randperm(t.numel(), generator=gen)].view_as(t).contiguous()
               for name, t in load_file(str(path)).items()}
    with open(path, "r+b") as f:
        f.write(save(tensors, metadata=metadata))
    after = path.stat()
    assert (after.st_size, after.st_ino) == (before.st_size, before.st_ino)


def test_vllm_start_after_weights_replaced_in_place_loads_nothing_and_answers_as_the_new_weights(own_model, tmp_path):
    pytest.importorskip("vllm")
    model, cfg = str(own_model), disk_config(tmp_path)
    old = run_once(model, tmp_path, cfg, [gen(LONG)], name="old")[0]
    assert len(list((tmp_path / "l2" / "blocks").glob("*/*.kvb"))) == len(LONG) // BS + 1

    replace_weights_in_place(own_model)
    # kvstrata on the same disk tier; the new weights' answer is the same prompt under a cache salt
    # of its own (nothing stored under it anywhere: computed from the new weights alone).
    with StepEngine(model, tmp_path, cfg, name="new") as after:
        new, reference = after.run([gen(LONG), gen(LONG, salt=salt())])
    assert new["cached"] == 0 and reference["cached"] == 0
    assert new["tokens"] == reference["tokens"]
    assert new["tokens"] != old["tokens"]  # the new weights answer differently: stale KV would show


def _model_version(server_log: str) -> str:
    """The version kvstrata logged at start (``resolve_model_version``); never an unverified one."""
    found = re.findall(r"kvstrata: model version (\S+) \(", server_log)
    assert len(found) == 1 and not found[0].startswith("unverified:"), found
    return found[0]


@needs_sglang
def test_sglang_start_after_weights_replaced_in_place_loads_nothing_and_answers_as_the_new_weights(own_model, tmp_path):
    """SGLang's harness always runs with the storage backend, so the reference for the new weights
    is the first request after the change: it reuses nothing (no storage, host or device tokens),
    which is what a server without the backend does. Both servers established a trusted identity.
    The servers run the legacy flat-page interface (``interface_v1: 0``): the old one, its caches
    flushed, serves the prompt from storage through it with the same output."""
    servers = SGLangServers(str(own_model), tmp_path)
    config = sglang_config(tmp_path / "sglang.json", tmp_path / "l2", v1=False)
    prompt = ids(11, 600)
    try:
        server = servers.get(config)
        old, _ = stored(server, config, prompt, block_files(config))
        server.flush()
        flushed = sglang_generate(server, prompt)
        assert storage_share(flushed, prompt) >= 0.9 and flushed["tokens"] == old["tokens"]
        assert "legacy flat-page interface" in sglang_log(server)
        old_version = _model_version(sglang_log(server))
        servers.stop()

        replace_weights_in_place(own_model)
        server = servers.get(config)
        new = sglang_generate(server, prompt)
        assert (new["storage"], new["host"], new["device"]) == (0, 0, 0)
        assert new["tokens"] != old["tokens"]  # the new weights answer differently: stale KV would show
        assert _model_version(sglang_log(server)) != old_version
    finally:
        servers.stop()
