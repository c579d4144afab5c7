"""A vision-language model on a real offline vLLM engine: a text prefix that requests
with different images share is served from kvstrata, and nothing from the first image on.

Scenario: kvstrata once keyed every block of a request on all of its multimodal items, so two
requests with one text prefix and different images shared nothing of it (vLLM's own prefix cache
shares it: it keys each block on the items that overlap that block). Each block now carries what
vLLM's ``generate_block_hash_extra_keys`` gives for it (adapters/vllm/request_keys.py; the keys
themselves are checked against vLLM's hashing in tests/adapters/test_vllm_request_keys.py).

The model is the ``vlm`` preset of examples/make_tiny_model.py: a tiny random Idefics3 (the tiny
Llama behind a SigLIP-style vision tower) that vLLM's CPU build serves without torchvision. Each
request is served after vLLM's own prefix cache is reset (connector untouched), so what it reuses
comes from kvstrata alone; its reference is the same engine's answer under a fresh cache salt
(nothing is stored under it: computed from its own inputs).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engines.launchers import BS, StepEngine, disk_config, ids, salt, tiny_model

pytestmark = pytest.mark.timeout(900)

BEFORE = ids(31, 2 * BS + 8)  # the shared text: 2 full blocks, and 8 tokens of the block the image starts in
AFTER = ids(32, 40)


def served(engine: StepEngine, prompt: list[int], **step) -> tuple[dict, list[int]]:
    """``prompt`` served after vLLM's own prefix cache is reset (what it reuses is kvstrata's),
    and the reference: the same request under a fresh salt."""
    got, ref = engine.run([{"op": "reset", "connector": False}, {"op": "generate", "prompt": prompt, **step},
                           {"op": "generate", "prompt": prompt, **step, "salt": salt()}])[1:]
    return got, ref["tokens"]


def test_a_text_prefix_shared_by_requests_with_other_images_is_served_and_nothing_from_the_image_on(tmp_path: Path):
    model = tiny_model("vlm")
    image_token = json.loads((Path(model) / "config.json").read_text())["image_token_id"]
    # The processor puts <fake_token_around_image> <global-img> <image> x image_seq_len
    # <fake_token_around_image> where the prompt has its one image token.
    span = json.loads((Path(model) / "processor_config.json").read_text())["image_seq_len"] + 3
    prompt = BEFORE + [image_token] + AFTER
    served_len = len(BEFORE) + span + len(AFTER)
    with StepEngine(model, tmp_path, disk_config(tmp_path), name="vlm", dtype="float32",
                    limit_mm_per_prompt={"image": 1}) as engine:
        first, first_ref = served(engine, prompt, images=[1])
        assert first["cached"] == 0 and first["tokens"] == first_ref

        # Another image after the same text: the text's full blocks come from kvstrata, nothing from
        # the block the image starts in.
        other, other_ref = served(engine, prompt, images=[2])
        assert other_ref != first_ref  # the images change the answer: a wrong hit would show
        assert other["cached"] == len(BEFORE) // BS * BS and other["tokens"] == other_ref

        # The first image again: everything but the last token comes from kvstrata.
        again, _ = served(engine, prompt, images=[1])
        assert again["cached"] == served_len - 1 and again["tokens"] == first_ref
