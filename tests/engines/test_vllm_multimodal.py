"""A vision-language model on real offline vLLM engines: a text prefix that requests with different
images share is served from kvstrata, nothing from the first image on, and images are keyed by
their content, whatever vLLM or a client names them.

Scenario 1: kvstrata once keyed every block of a request on all of its multimodal items, so two
requests with one text prefix and different images shared nothing of it (vLLM's own prefix cache
shares it: it keys each block on the items that overlap that block). Each block now carries the
items that overlap it (adapters/vllm/request_keys.py).

Scenario 2 (issue 49): kvstrata keyed an item on vLLM's name for it (``identifier``). With prefix
caching off and ``mm_processor_cache_gb=0`` that name is a per-process counter
(``renderer0-mm-1-image-0``), so a fresh process on the same L2 was served the previous process's
first image for its own first image; and a client's ``multi_modal_uuids`` value is the name as
given, so one UUID on two images served the first image's KV for the second. Items are now keyed
on their processed data (adapters/vllm/mm_items.py; the keys themselves are checked in
tests/adapters/test_vllm_request_keys.py).

Two engine processes in turn on one L2 folder, both with prefix caching off (so whatever a request
reuses comes from kvstrata alone) and vLLM's multimodal processor cache off. The model is the
``vlm`` preset of examples/make_tiny_model.py: a tiny random Idefics3 (the tiny Llama behind a
SigLIP-style vision tower) that vLLM's CPU build serves without torchvision. Each answer's
reference is the same engine's answer under a fresh cache salt (nothing is stored under it:
computed from its own inputs).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engines.launchers import BS, StepEngine, disk_config, ids, salt, tiny_model

pytestmark = pytest.mark.timeout(900)

BEFORE = ids(31, 2 * BS + 8)  # the shared text: 2 full blocks, and 8 tokens of the block the image starts in
AFTER = ids(32, 40)
NAMED = ids(36, 3 * BS + 5)  # the text before the images the client names (multi_modal_uuids)
UUID = "9f" * 32  # the client's name for two different images: shaped like a SHA-256, as vLLM's own
ENGINE = {"name": "vlm", "dtype": "float32", "limit_mm_per_prompt": {"image": 1}, "prefix_caching": False,
          "mm_processor_cache_gb": 0}


def served(engine: StepEngine, steps: list[dict[str, Any]]) -> list[tuple[dict, list[int]]]:
    """Each generate step's result, and its reference: the same request under a fresh salt."""
    out = engine.run([s for step in steps for s in (step, {**step, "salt": salt()})])
    return [(got, ref["tokens"]) for got, ref in zip(out[::2], out[1::2])]


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The model, its prompts, and the first process's answers (it has stored them on ``cfg``'s L2
    when this returns). Its first multimodal request is image 1 after ``BEFORE``: vLLM names that
    item ``renderer0-mm-1-image-0`` in every process."""
    model = tiny_model("vlm")
    image_token = json.loads((Path(model) / "config.json").read_text())["image_token_id"]
    # The processor puts <fake_token_around_image> <global-img> <image> x image_seq_len
    # <fake_token_around_image> where the prompt has its one image token.
    span = json.loads((Path(model) / "processor_config.json").read_text())["image_seq_len"] + 3
    tmp = tmp_path_factory.mktemp("vlm")
    cfg = disk_config(tmp)
    prompt, named = BEFORE + [image_token] + AFTER, NAMED + [image_token] + AFTER
    with StepEngine(model, tmp, cfg, **ENGINE) as engine:
        first, other, again, by_uuid = served(engine, [
            {"op": "generate", "prompt": prompt, "images": [1]},
            {"op": "generate", "prompt": prompt, "images": [2]},
            {"op": "generate", "prompt": prompt, "images": [1]},
            {"op": "generate", "prompt": named, "images": [1], "uuids": [UUID]}])
    return {"model": model, "tmp": tmp, "cfg": cfg, "prompt": prompt, "named": named,
            "served_len": len(BEFORE) + span + len(AFTER), "named_len": len(NAMED) + span + len(AFTER),
            "first": first, "other": other, "again": again, "by_uuid": by_uuid}


def test_a_text_prefix_shared_by_requests_with_other_images_is_served_and_nothing_from_the_image_on(vlm):
    (first, first_ref), (other, other_ref), (again, _) = vlm["first"], vlm["other"], vlm["again"]
    assert first["cached"] == 0 and first["tokens"] == first_ref
    # Another image after the same text: the text's full blocks come from kvstrata, nothing from
    # the block the image starts in.
    assert other_ref != first_ref  # the images change the answer: a wrong hit would show
    assert other["cached"] == len(BEFORE) // BS * BS and other["tokens"] == other_ref
    # The first image again: everything but the last token comes from kvstrata.
    assert again["cached"] == vlm["served_len"] - 1 and again["tokens"] == first_ref


def test_a_fresh_process_never_serves_another_image_stored_under_the_same_name(vlm):
    """The second process's first image (3) gets the name the first process gave image 1; the
    client's UUID names image 1 in the first process and image 3 in the second. Neither loads
    anything from the image on, and both answer as their references. The same image under
    another name (a later counter value, another UUID) is served whole: keyed by its pixels."""
    (_, first_ref), (by_uuid, by_uuid_ref) = vlm["first"], vlm["by_uuid"]
    assert by_uuid["cached"] == 0 and by_uuid["tokens"] == by_uuid_ref
    with StepEngine(vlm["model"], vlm["tmp"], vlm["cfg"], **ENGINE) as engine:
        (text, text_ref), (named, named_ref), (same, _), (renamed, _) = served(engine, [
            {"op": "generate", "prompt": vlm["prompt"], "images": [3]},
            {"op": "generate", "prompt": vlm["named"], "images": [3], "uuids": [UUID]},
            {"op": "generate", "prompt": vlm["prompt"], "images": [1]},
            {"op": "generate", "prompt": vlm["named"], "images": [1], "uuids": ["another-" + UUID]}])
    assert text_ref != first_ref and named_ref != by_uuid_ref  # a wrong hit would show in the answers
    # tokens loaded from kvstrata: the text's full blocks; all but the last token
    assert {"counter name": text["cached"], "uuid": named["cached"], "same image": same["cached"],
            "same image, other uuid": renamed["cached"]} == {
        "counter name": len(BEFORE) // BS * BS, "uuid": len(NAMED) // BS * BS, "same image": vlm["served_len"] - 1,
        "same image, other uuid": vlm["named_len"] - 1}
    assert [text["tokens"], named["tokens"], same["tokens"], renamed["tokens"]] == [
        text_ref, named_ref, first_ref, by_uuid_ref]
