"""What a vLLM request's blocks are keyed on beyond their token ids (adapters/vllm/request_keys.py),
checked against vLLM's own prefix-cache hashing on real ``vllm.v1.request.Request`` objects: no
engine starts.

The rule: kvstrata's identity is never smaller than vLLM's. Wherever vLLM's own block hashes of two
requests differ, kvstrata's keys differ too (``assert_never_smaller``); and where the only
difference is positional (an image, embedding rows), blocks before it keep their keys, so a
shared prefix still hits. One exception, on purpose: a multimodal item is keyed by its processed
data, not by vLLM's name for it (a per-process counter or a client's UUID), so the same image
under two names shares its keys, and two images under one name do not. The engines:
tests/engines/test_vllm_identity.py, tests/engines/test_vllm_multimodal.py.
"""

from __future__ import annotations

import os
import tempfile
import time
import weakref
from pathlib import Path

import numpy as np
import pytest
from tests.builders import make_config

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.multimodal.inputs import (MultiModalBatchedField, MultiModalFeatureSpec, MultiModalFieldElem,  # noqa: E402
                                    MultiModalFlatField, MultiModalKwargsItem, PlaceholderRange)
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from kvstrata.adapters.vllm import mm_items  # noqa: E402
from kvstrata.adapters.vllm.mm_items import item_digest, unhashed_items  # noqa: E402
from kvstrata.adapters.vllm.request_keys import encode, request_keys  # noqa: E402
from kvstrata.adapter_versions import AdapterVersions  # noqa: E402
from kvstrata.keys import NO_EXTRA, chain_keys, extra_digest, root_key  # noqa: E402

BS = 16
ROOT = root_key(b"\x01" * 16, 7)
PROMPT = list(range(100, 100 + 6 * BS + 5))  # 6 full blocks and a tail

init_none_hash(sha256)
HASHER = get_request_block_hasher(BS, sha256)


_IMAGES: dict[str, MultiModalKwargsItem] = {}


def image(name: str) -> MultiModalKwargsItem:
    """A processed image as the EngineCore holds it (Idefics3's fields: flat ``pixel_values`` of 2
    patches, batched ``num_patches``), its pixels drawn from ``name``; one object per name, as
    vLLM's LRU receiver cache hands one object to every request that reuses an item."""
    if name not in _IMAGES:
        gen = torch.Generator().manual_seed(int.from_bytes(name.encode(), "little") % 2**63)
        _IMAGES[name] = MultiModalKwargsItem({
            "pixel_values": MultiModalFieldElem(torch.randn(2, 3, 8, 8, generator=gen),
                                                MultiModalFlatField(slices=[slice(0, 2)], dim=0)),
            "num_patches": MultiModalFieldElem(torch.tensor(2), MultiModalBatchedField()),
        })
    return _IMAGES[name]


def request(tokens=PROMPT, *, salt=None, lora=None, mm=(), embeds=None, mask=None, rid="r"):  # noqa: ANN001, ANN201
    """A real vLLM request, its block hashes computed by vLLM's own hasher. ``mm``: items as
    (name, offset, length) with the pixels ``image(name)``, or (identifier, offset, length, data):
    vLLM's name for the item and its data (a ``MultiModalKwargsItem``, or None)."""
    features = [MultiModalFeatureSpec(data=image(m[0]) if len(m) == 3 else m[3], modality="image", identifier=m[0],
                                      mm_position=PlaceholderRange(offset=m[1], length=m[2])) for m in mm]
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


COUNTER_NAME = "renderer0-mm-1-image-0"  # vLLM's name of a process's first item, prefix caching and mm cache off
CLIENT_UUID = "9f" * 32  # a client's multi_modal_uuids value: any string, here shaped like a SHA-256


@pytest.mark.parametrize("name", [COUNTER_NAME, CLIENT_UUID])
def test_two_images_under_one_name_share_the_text_before_them_and_nothing_from_the_image_on(name):
    """Scenario: vLLM names an item by a per-process counter (prefix caching off,
    mm_processor_cache_gb=0: a restarted engine's first image has the previous one's name) or by a
    client's UUID, and kvstrata keyed the image's blocks on that name: a second process served the
    first image's KV for another image. vLLM's own hashes cannot tell the two apart; kvstrata's
    keys, made from the pixels, do."""
    cat, dog = request(mm=[(name, 40, 32, image("cat"))]), request(mm=[(name, 40, 32, image("dog"))])
    assert cat.block_hashes == dog.block_hashes  # the hole: vLLM keys the name
    k_cat, k_dog = keys_of(cat), keys_of(dog)
    assert k_cat[:2] == k_dog[:2] == keys_of(request())[:2]
    assert all(a != b for a, b in zip(k_cat[2:], k_dog[2:]))


def test_the_same_image_under_two_names_shares_its_keys():
    """The counter form and a client's UUID for one image (and a copy of its data, another
    object): the same keys throughout, where vLLM's hashes differ from the image on."""
    copy = MultiModalKwargsItem({k: MultiModalFieldElem(e.data.clone(), e.field) for k, e in image("cat").items()})
    by_counter = request(mm=[(COUNTER_NAME, 40, 32, image("cat"))])
    by_uuid = request(mm=[(CLIENT_UUID, 40, 32, copy)])
    assert by_counter.block_hashes[2:] != by_uuid.block_hashes[2:]
    assert keys_of(by_counter) == keys_of(by_uuid) == keys_of(request(mm=[("cat", 40, 32)]))


def shm_address() -> MultiModalKwargsItem:
    """What the EngineCore holds with ``mm_processor_cache_type="shm"``: the address of the data
    in shared memory (vllm/multimodal/cache/shm.py ``address_as_item``), not the data."""
    return MultiModalKwargsItem({name: MultiModalFieldElem(value, MultiModalBatchedField())
                                 for name, value in (("address", 4096), ("monotonic_id", 1), ("signature", [7, 7]))})


@pytest.mark.parametrize("data", [None, shm_address()], ids=["stripped", "shm-address"])
def test_an_item_without_its_data_is_keyed_apart_and_never_shared(data):
    """No content to hash: the blocks from the item on are this request's alone (not even the same
    request again shares them, nor one with the pixels); the text before it is still shared; the
    item is counted."""
    before = unhashed_items()
    first, again = (keys_of(request(mm=[(COUNTER_NAME, 40, 32, data)])) for _ in range(2))
    with_pixels = keys_of(request(mm=[(COUNTER_NAME, 40, 32, image("cat"))]))
    assert first[:2] == again[:2] == with_pixels[:2]
    assert all(a != b != c for a, b, c in zip(first[2:], again[2:], with_pixels[2:]))
    assert unhashed_items() == before + 2


def test_unkeyed_items_reach_the_engines_metrics():
    """The count of items keyed apart travels with the scheduler's stats to ``/metrics``
    (``kvstrata_mm_items_unkeyed_total``), as a delta per report."""
    from kvstrata.adapters.vllm.metrics import StatsCollector
    from kvstrata.metrics import SOURCES
    from kvstrata.store import BlockStore

    assert "mm_items_unkeyed" in SOURCES
    with BlockStore(make_config(tempfile.mkdtemp())) as store:
        stats = StatsCollector(store)
        stats.collect()
        keys_of(request(mm=[(COUNTER_NAME, 40, 32, None)]))
        assert stats.collect().data["counters"]["mm_items_unkeyed"] == 1
        assert stats.collect() is None  # nothing moved since


def test_item_digests_cover_keys_fields_dtypes_shapes_and_bytes_not_the_batch_they_came_in():
    pixels = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)

    def item(data=pixels, key="pixel_values", field=None):  # noqa: ANN001, ANN202
        field = field or MultiModalFlatField(slices=[slice(0, 2)])
        return MultiModalKwargsItem({key: MultiModalFieldElem(data, field)})

    base = item_digest(item())
    assert len(base) == 16 and item_digest(item(pixels.clone())) == base
    others = [item(pixels.reshape(3, 2, 4)), item(pixels.view(torch.int32)), item(pixels.double()),
              item(key="image_embeds"), item(field=MultiModalBatchedField()),
              item(field=MultiModalFlatField(slices=[slice(0, 2)], dim=1)), item([pixels[0], pixels[1]]),
              item(pixels + 1e-6)]
    assert len({base, *(item_digest(o) for o in others)}) == len(others) + 1
    # the batch's slices (which depend on the items processed together) are not content
    assert item_digest(item(field=MultiModalFlatField(slices=[slice(3, 5), slice(0, 3)]))) == base
    assert item_digest(item(pixels.transpose(0, 2).contiguous().transpose(0, 2))) == base  # strided: its values
    bf16 = item(pixels.bfloat16())
    assert item_digest(bf16) not in (base, None)


def test_the_digest_cache_never_gives_a_dead_items_digest_to_a_new_item_at_its_id():
    """Digests are cached per item object, keyed by id(); an id is reused once its object is
    gone, and the new object (other pixels) must get its own digest."""
    def elems(seed: int) -> dict[str, MultiModalFieldElem]:
        return {"pixel_values": MultiModalFieldElem(torch.full((4,), float(seed)), MultiModalBatchedField())}

    reused = 0
    for seed in range(1, 51):
        old_elems, new_elems = elems(0), elems(seed)  # kept alive: only the item itself is freed below
        first = MultiModalKwargsItem(old_elems)
        old_id, old_digest = id(first), item_digest(first)
        assert item_digest(first) is old_digest and old_id in mm_items._cache  # cached while it lives
        del first
        assert old_id not in mm_items._cache  # forgotten with its object
        new = MultiModalKwargsItem(new_elems)  # CPython most often puts it where the old one was
        reused += id(new) == old_id
        assert item_digest(new) != old_digest
        if reused:
            break
    assert reused, "no new item ever got a freed item's id (allocator behaviour changed)"
    # an entry at the id that is not this object's (its object's callback not run yet) is not served
    other = MultiModalKwargsItem(elems(7))
    mm_items._cache[id(new)] = (weakref.ref(other), old_digest)
    assert item_digest(new) != old_digest
