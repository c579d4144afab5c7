"""What a vLLM request's blocks are keyed on beyond their token ids (adapters/vllm/request_keys.py),
checked against vLLM's own prefix-cache hashing on real ``vllm.v1.request.Request`` objects: no
engine starts.

The rule: kvstrata's identity is never smaller than vLLM's. Wherever vLLM's own block hashes of two
requests differ, kvstrata's keys differ too (``test_..._never_smaller_than_vllms``); and where the
only difference is positional (an image, embedding rows), blocks before it keep their keys, so a
shared prefix still hits. The engines: tests/engines/test_vllm_identity.py.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from kvstrata.adapters.vllm.request_keys import encode, request_keys  # noqa: E402
from kvstrata.adapter_versions import AdapterVersions  # noqa: E402
from kvstrata.keys import NO_EXTRA, chain_keys, extra_digest, root_key  # noqa: E402

BS = 16
ROOT = root_key(b"\x01" * 16, 7)
PROMPT = list(range(100, 100 + 6 * BS + 5))  # 6 full blocks and a tail

init_none_hash(sha256)
HASHER = get_request_block_hasher(BS, sha256)


def request(tokens=PROMPT, *, salt=None, lora=None, mm=(), embeds=None, mask=None, rid="r"):  # noqa: ANN001, ANN201
    """A real vLLM request, its block hashes computed by vLLM's own hasher."""
    features = [MultiModalFeatureSpec(data=None, modality="image", identifier=ident,
                                      mm_position=PlaceholderRange(offset=off, length=n)) for ident, off, n in mm]
    return Request(rid, list(tokens) if tokens is not None else None, SamplingParams(max_tokens=1), None,
                   prompt_embeds=embeds, prompt_is_token_ids=mask, mm_features=features or None,
                   lora_request=lora, cache_salt=salt, block_hasher=HASHER)


def keys_of(req: Request, adapters: AdapterVersions | None = None) -> list[bytes]:
    rk = request_keys(req, adapters or AdapterVersions())
    assert rk is not None
    return chain_keys(ROOT, rk.tokens, BS, rk.extra, partial=False).keys


def assert_never_smaller(a: Request, b: Request, adapters: AdapterVersions | None = None) -> None:
    """Block by block: wherever vLLM's hashes of ``a`` and ``b`` differ, kvstrata's keys differ."""
    adapters = adapters or AdapterVersions()
    ours_a, ours_b = keys_of(a, adapters), keys_of(b, adapters)
    assert len(ours_a) == len(a.block_hashes) == len(b.block_hashes) == len(ours_b)
    for i, (va, vb) in enumerate(zip(a.block_hashes, b.block_hashes)):
        if va != vb:
            assert ours_a[i] != ours_b[i], f"block {i}: vLLM tells the requests apart, kvstrata does not"


def test_a_plain_request_is_keyed_on_its_tokens_alone_and_a_salt_on_every_block():
    assert request_keys(request(), AdapterVersions()).extra == NO_EXTRA
    assert request_keys(request(salt="t1"), AdapterVersions()).extra == extra_digest(["salt:t1"])
    assert_never_smaller(request(salt="t1"), request(salt="t2"))


def test_multimodal_blocks_are_keyed_on_the_items_that_overlap_them_and_a_shared_prefix_still_hits():
    """Two requests with one text prefix (blocks 0-1) and different images at tokens 40..71:
    the blocks before the image keep their plain keys in both; from the image's first block on,
    nothing matches; vLLM's own per-block keys are the floor throughout."""
    cat, dog = request(mm=[("cat", 40, 32)]), request(mm=[("dog", 40, 32)])
    plain = keys_of(request())
    k_cat, k_dog = keys_of(cat), keys_of(dog)
    assert k_cat[:2] == k_dog[:2] == plain[:2]  # the shared text prefix hits
    assert all(a != b for a, b in zip(k_cat[2:], k_dog[2:]))  # nothing from the image on
    assert all(a != b for a, b in zip(k_cat[2:], plain[2:]))
    assert_never_smaller(cat, dog)
    # The same image at another offset in the same placeholder tokens is another KV: vLLM keys its
    # offset in the block, and so does kvstrata.
    assert_never_smaller(request(mm=[("cat", 40, 32)]), request(mm=[("cat", 41, 31)]))
    # The same image twice gives the same keys (and vLLM's hashes agree).
    assert keys_of(request(mm=[("cat", 40, 32)])) == k_cat


def test_each_block_is_keyed_on_the_images_that_overlap_it_alone():
    """Several images, one across block boundaries (tokens 20..49: blocks 1-3) and one inside
    block 4: a block's own digest changes with the images that overlap it and with no other; the
    chained keys share everything before the first image that differs; an image at the very first
    token leaves no block shared with the plain prompt."""
    cat_sun, dog_sun = request(mm=[("cat", 20, 30), ("sun", 70, 10)]), request(mm=[("dog", 20, 30), ("sun", 70, 10)])
    cat_moon = request(mm=[("cat", 20, 30), ("moon", 70, 10)])
    own = {r: request_keys(r, AdapterVersions()).extra for r in (cat_sun, dog_sun, cat_moon)}
    for lo in range(0, 6 * BS, BS):
        overlaps_cat, overlaps_sun = lo < 50 and lo + BS > 20, lo < 80 and lo + BS > 70
        assert (own[cat_sun].digest(lo, lo + BS) != own[dog_sun].digest(lo, lo + BS)) == overlaps_cat, lo
        assert (own[cat_sun].digest(lo, lo + BS) != own[cat_moon].digest(lo, lo + BS)) == overlaps_sun, lo
    k_cat_sun, k_cat_moon, plain = keys_of(cat_sun), keys_of(cat_moon), keys_of(request())
    assert k_cat_sun[:4] == k_cat_moon[:4] and all(a != b for a, b in zip(k_cat_sun[4:], k_cat_moon[4:]))
    assert k_cat_sun[0] == plain[0] and all(a != b for a, b in zip(k_cat_sun[1:], plain[1:]))
    assert_never_smaller(cat_sun, dog_sun)
    assert_never_smaller(cat_sun, cat_moon)
    first = request(mm=[("cat", 0, 20)])
    assert all(a != b for a, b in zip(keys_of(first), plain))
    assert_never_smaller(first, request(mm=[("dog", 0, 20)]))


def embeds_request(seed: int | None, rid: str = "e") -> Request:
    """A mixed prompt: token ids with rows 32..63 given as embeddings (vLLM's prompt_is_token_ids
    form); ``seed`` None: the rows are zeros."""
    rows = torch.zeros(len(PROMPT), 8)
    if seed is not None:
        rows[32:64] = torch.randn(32, 8, generator=torch.Generator().manual_seed(seed))
    mask = [not 32 <= i < 64 for i in range(len(PROMPT))]
    return request(embeds=rows, mask=mask, rid=rid)


def test_mixed_prompt_embedding_blocks_are_keyed_on_their_rows():
    """Other embeddings at the same placeholder positions, zeros there, or a plain prompt with 0 at
    those positions (what vLLM puts in ``all_token_ids``): all different from block 2 on, as in
    vLLM; the blocks before the embeddings are shared by the mixed prompts (vLLM hashes every
    block's rows of a mixed prompt, so a plain prompt shares none of them, in vLLM as here)."""
    one, other, zeros = embeds_request(1), embeds_request(2), embeds_request(None)
    plain_zeros = request([0 if 32 <= i < 64 else t for i, t in enumerate(PROMPT)])
    k1, k2, kz, kp = keys_of(one), keys_of(other), keys_of(zeros), keys_of(plain_zeros)
    assert k1[:2] == k2[:2] == kz[:2]
    for theirs in (k2, kz, kp):
        assert all(a != b for a, b in zip(k1[2:], theirs[2:]))
    assert keys_of(embeds_request(1, rid="again")) == k1
    assert_never_smaller(one, other)
    assert_never_smaller(one, plain_zeros)


def test_prompts_of_embeddings_alone_are_keyed_on_their_rows_in_every_block():
    """No token ids at all (vLLM keys them on zeros and each block's rows): other rows anywhere,
    another key from that block on; the same rows, the same keys."""
    rows = torch.randn(len(PROMPT), 8, generator=torch.Generator().manual_seed(5))
    other = rows.clone()
    other[50] += 1.0  # block 3 (48..63) differs
    k1, k2 = keys_of(request(None, embeds=rows)), keys_of(request(None, embeds=other))
    assert k1[:3] == k2[:3] and all(a != b for a, b in zip(k1[3:], k2[3:]))
    assert keys_of(request(None, embeds=rows.clone(), rid="again")) == k1
    assert_never_smaller(request(None, embeds=rows), request(None, embeds=other))


def test_a_tail_block_is_keyed_on_the_inputs_of_its_own_range():
    """The partial tail of a mixed prompt whose embeddings reach into it gets its rows' digest."""
    rows = torch.zeros(len(PROMPT), 8)
    mask = [i < len(PROMPT) - 3 for i in range(len(PROMPT))]  # the last 3 tokens are embeddings
    a = request(embeds=rows.clone(), mask=mask)
    rows[-1] = 1.0
    b = request(embeds=rows, mask=mask)
    ka, kb = (request_keys(r, AdapterVersions()) for r in (a, b))
    full, tail = 6 * BS, slice(6 * BS, len(PROMPT))
    assert ka.extra.digest(0, full) == kb.extra.digest(0, full)
    assert ka.extra.digest(tail.start, tail.stop) != kb.extra.digest(tail.start, tail.stop)


def write_adapter(folder: Path, value: float) -> Path:
    """A LoRA adapter's files (config and weights): ``value`` stands for its weights."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}')
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.full((64, 8), value)},
              str(folder / "adapter_model.safetensors"))
    return folder


def rewrite_in_place(folder: Path, value: float) -> None:
    """The adapter's weights overwritten: same names, same size; a later mtime."""
    path = folder / "adapter_model.safetensors"
    before = path.stat()
    write_adapter(folder, value)
    os.utime(path, ns=(before.st_mtime_ns + 10_000_000_000, before.st_mtime_ns + 10_000_000_000))


@pytest.fixture
def identity_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSTRATA_CACHE_DIR", str(tmp_path / "identity-cache"))


def test_a_lora_name_and_id_reused_for_other_weights_never_share_keys(tmp_path, identity_cache):
    """Re-pointed to another path; overwritten in place (seen by a new process, as after a restart
    that numbers adapters from 1 again); vLLM's own keys (name and path) as the floor."""
    a, b = write_adapter(tmp_path / "a", 0.5), write_adapter(tmp_path / "b", -0.5)
    k_a = keys_of(request(lora=LoRARequest("x", 1, str(a))))
    k_b = keys_of(request(lora=LoRARequest("x", 1, str(b))))
    assert not set(k_a) & set(k_b)
    assert_never_smaller(request(lora=LoRARequest("x", 1, str(a))), request(lora=LoRARequest("x", 1, str(b))))
    # The same adapter under another id (a restart numbering differently): the same content, shared.
    assert keys_of(request(lora=LoRARequest("x", 2, str(a)))) == k_a
    rewrite_in_place(a, 0.25)
    after = keys_of(request(lora=LoRARequest("x", 1, str(a))))  # a new process: fingerprinted anew
    assert not set(after) & set(k_a)


def test_an_adapter_rewritten_under_a_running_engine_is_neither_served_nor_stored_unless_reloaded(
        tmp_path, identity_cache):
    """Within one process the engine may still hold the old files (it loaded the adapter before):
    no keys at all, until a request asks vLLM to reload the files (``load_inplace``)."""
    a = write_adapter(tmp_path / "a", 0.5)
    adapters = AdapterVersions()
    first = keys_of(request(lora=LoRARequest("x", 1, str(a))), adapters)
    rewrite_in_place(a, 0.25)
    assert request_keys(request(lora=LoRARequest("x", 1, str(a))), adapters) is None
    reloaded = keys_of(request(lora=LoRARequest("x", 1, str(a), load_inplace=True)), adapters)
    assert not set(reloaded) & set(first)
    assert keys_of(request(lora=LoRARequest("x", 1, str(a))), adapters) == reloaded  # settled again


def test_adapter_fingerprints_are_computed_once_per_load_then_cost_a_stat(tmp_path, identity_cache):
    a = write_adapter(tmp_path / "a", 0.5)
    adapters = AdapterVersions()
    adapters.version(1, str(a))
    started = time.perf_counter()
    for _ in range(200):
        adapters.version(1, str(a))
    assert (time.perf_counter() - started) / 200 < 0.002  # a few stats, no reading of weights


def test_extra_keys_encode_canonically():
    values = [("a", "bc"), ("ab", "c"), ("a", b"bc"), ("a", 1), ("a", "1"), (("a",), "b"), ("a", None), ("a", True)]
    assert len({encode(v) for v in values}) == len(values)
    assert encode(("mm", "h", 3)) == encode(["mm", "h", 3])
    with pytest.raises(TypeError):
        encode((object(),))


def test_per_block_digests_cost_no_per_token_work():
    """A long prompt with an image: one vLLM extra-keys call per block, cached for the request."""
    long = list(np.arange(4096) % 3000)
    req = request(long, mm=[("cat", 1000, 600)])
    rk = request_keys(req, AdapterVersions())
    started = time.perf_counter()
    chain_keys(ROOT, rk.tokens, BS, rk.extra, partial=False)
    first = time.perf_counter() - started
    started = time.perf_counter()
    chain_keys(ROOT, rk.tokens, BS, rk.extra, partial=False)
    again = time.perf_counter() - started
    assert first < 0.05 and again < first + 0.005
