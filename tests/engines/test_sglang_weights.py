"""A weight update made in memory on one real SGLang server is a reset of the weights kind: joined by
the other servers, never caught (issue 50, part 6), on two servers sharing one disk tier and its
epochs (one L2 folder: two servers of one host).

Before: SGLang's ``update_weights_from_disk/tensor/distributed`` never reached the storage backend,
and the namespace is the same before and after (it fingerprints the files the server started from).
The server that updated loaded the pages of the weights it had left, and the servers still on the
old weights would have loaded what it computed with the new ones. Now the update is the store's
reset (``kvstrata.adapters.sglang.weights``), and the other server serves and saves nothing of the
new epoch until it updates too, which joins that epoch.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from engines.launchers import PAGE, ids, needs_sglang, salt, sglang_config, sglang_generate, sglang_log
from engines.test_sglang import block_files, storage_share
from tests.harness.sglang_server import SGLangServer

# Two server starts, on 2 cores shared with the other test worker.
pytestmark = pytest.mark.timeout(900)

P, Q = ids(61, 600), ids(62, 600)  # 37 full pages each


def other_weights(model: str, folder: Path) -> Path:
    """A copy of the model whose every weight is scaled by ``1 + 0.5 * N(0, 1)`` (seeded): the same
    shapes and config, other outputs."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(model, folder)
    gen = torch.Generator().manual_seed(11)
    for path in sorted(folder.glob("*.safetensors")):
        tensors = {name: (t.float() * (1 + 0.5 * torch.randn(t.shape, generator=gen))).to(t.dtype)
                   for name, t in sorted(load_file(str(path)).items())}
        save_file(tensors, str(path), metadata={"format": "pt"})
    return folder


def update_weights(server: SGLangServer, folder: Path) -> None:
    """``POST /update_weights_from_disk`` (the update's own cache flush included), the server idle."""
    server.flush()  # the write-backs of earlier requests are done: the update's flush is not refused
    out = server.post("/update_weights_from_disk", {"model_path": str(folder)})
    assert out["success"], out


def wait_pages(cfg: Path, before: set[Path], pages: int) -> None:
    """Until ``pages`` new page files are on the disk tier (write-backs are asynchronous)."""
    deadline = time.monotonic() + 60
    while len(block_files(cfg) - before) < pages:
        assert time.monotonic() < deadline, f"{len(block_files(cfg) - before)} of {pages} pages on the disk tier"
        time.sleep(0.2)


@needs_sglang
def test_a_weight_update_on_one_server_is_joined_by_the_other_not_caught(sglang_server, model, tmp_path):
    """Scenario: servers A and B share one disk tier; A computes P and B loads it. A updates its
    weights in memory: it loads nothing of P (the old weights' pages) and answers as its new weights
    do under a fresh cache salt. B, still on the old weights, loads none of A's new pages of P, and
    what it computes (Q) reaches no file. B then takes the same weights: it joins A's epoch (no new
    generation), loads A's pages of P and answers as A does; its own pages of Q are saved again, and
    A loads them."""
    new_weights = other_weights(model, tmp_path / "new-weights")
    cfg = sglang_config(tmp_path / "kvstrata.json", tmp_path / "l2")
    a, b = sglang_server(cfg), sglang_server(cfg)

    files = block_files(cfg)
    old = sglang_generate(a, P)
    wait_pages(cfg, files, len(P) // PAGE)
    shared = sglang_generate(b, P)
    assert storage_share(shared, P) >= 0.9 and shared["tokens"] == old["tokens"]  # the tier is shared

    update_weights(a, new_weights)
    files = block_files(cfg)
    new = sglang_generate(a, P)
    assert new["storage"] == 0 and new["device"] == 0, new  # nothing of the weights A has left
    assert new["tokens"] == sglang_generate(a, P, cache_salt=salt())["tokens"]  # A's new weights, computed
    assert new["tokens"] != old["tokens"]  # the weights change P's output: a wrong load would show
    wait_pages(cfg, files, len(P) // PAGE)  # A saves under its new epoch

    b.flush()  # B's device and host caches: what B then serves of P comes from storage or B's compute
    files = block_files(cfg)
    behind = sglang_generate(b, P)
    computed = sglang_generate(b, Q)
    assert behind["storage"] == 0 and behind["tokens"] == old["tokens"], behind  # none of A's pages
    assert computed["tokens"] == sglang_generate(b, Q, cache_salt=salt())["tokens"]  # B's old weights
    b.flush()  # refused until B's write-backs are done
    assert block_files(cfg) == files  # B saved nothing of the old weights under A's epoch
    assert "was reset by another instance" in sglang_log(b)

    update_weights(b, new_weights)
    files = block_files(cfg)
    joined = sglang_generate(b, P)
    assert storage_share(joined, P) >= 0.9 and joined["tokens"] == new["tokens"], joined  # A's pages
    assert "joined epoch" in sglang_log(b) and "joined epoch" not in sglang_log(a)
    mine = sglang_generate(b, Q)
    assert mine["storage"] == 0 and mine["tokens"] != computed["tokens"]
    wait_pages(cfg, files, len(Q) // PAGE)  # B saves again, under the epoch A made
    a.flush()
    loaded = sglang_generate(a, Q)
    assert storage_share(loaded, Q) >= 0.9 and loaded["tokens"] == mine["tokens"]
