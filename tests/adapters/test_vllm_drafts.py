"""Block keys of requests whose drafter's KV at a position depends on later tokens (EAGLE-style
heads: adapters/vllm/drafts.py), on real ``vllm.v1.request.Request`` objects and a real
``BlockStore``; no engine starts. The engines: tests/engines/test_vllm_spec.py (EAGLE hits) and
tests/engines/test_vllm_verify.py (EAGLE at ``verify.sample_rate: 1.0``).

The rule: a full block's key covers the tokens after it that its draft KV was computed from; a
block whose next token is not known yet matches nothing and is not final; a partial tail is keyed
on its own tokens (a hit never covers its last slot).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.config import SpeculativeConfig, VllmConfig  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from kvstrata.adapters.vllm.drafts import DraftInputs, draft_inputs, draft_lookahead  # noqa: E402
from kvstrata.keys import digest16, extra_digest  # noqa: E402
from tests.builders import BLOCK_SIZE as BS, make_namespace, payloads_for, random_tokens  # noqa: E402

P = random_tokens("drafts-p", 2 * BS).tolist()  # a shared prefix that ends at a block edge
X, Y = random_tokens("drafts-x", BS + 5).tolist(), random_tokens("drafts-y", BS + 5).tolist()
BASE = extra_digest(["salt:s"])  # a request's own extra digest (``request_keys``)


def request(tokens: list[int], outputs: list[int] = (), lookahead: int = 1) -> tuple[Request, DraftInputs]:
    req = Request(f"r{len(tokens)}-{tokens[-1]}", list(tokens), SamplingParams(max_tokens=8), None)
    if outputs:
        req.append_output_token_ids(list(outputs))
    extra = draft_inputs(req, BASE, BS, lookahead)
    assert isinstance(extra, DraftInputs)
    return req, extra


def digests(extra: DraftInputs, n_tokens: int) -> list[bytes]:
    """The digests of the full blocks and the tail of the first ``n_tokens`` tokens, as
    ``chain_keys`` asks for them."""
    return [extra.digest(i, min(i + BS, n_tokens)) for i in range(0, n_tokens, BS)]


def test_the_next_token_is_in_a_full_blocks_digest_and_not_in_a_partial_tails():
    _, a = request(P + X)
    _, b = request(P + Y)
    da, db = digests(a, len(P) + BS + 5), digests(b, len(P) + BS + 5)
    assert da[0] == db[0]  # block 0: its next token is P's, in both
    assert da[1] != db[1]  # P's last block: X[0] or Y[0] follows it
    assert da[1] == digests(request(P + X[:1])[1], len(P) + 1)[1]  # that token alone decides
    # A tail is keyed on its tokens and the request's inputs only: whatever follows it (the token
    # the request samples), the same digest as without a drafter.
    _, c = request(P + X, outputs=[7])
    _, d = request(P + X, outputs=[9])
    assert c.digest(len(P) + BS, len(P) + BS + 5) == d.digest(len(P) + BS, len(P) + BS + 5) == BASE
    assert digests(c, len(P) + BS + 5) == digests(d, len(P) + BS + 5) == da


def test_a_block_whose_next_token_is_unknown_matches_no_other_and_is_final_once_it_is_known():
    req, a = request(P)  # the prompt ends with its block: the request samples the next token
    _, b = request(P)
    last = a.digest(BS, 2 * BS)
    assert a.known_blocks() == 1
    assert last == a.digest(BS, 2 * BS)  # the same within the request
    assert last != b.digest(BS, 2 * BS)  # another request's: never the same
    known = {request(P + [t])[1].digest(BS, 2 * BS) for t in range(10, 60)}
    assert last not in known and b.digest(BS, 2 * BS) not in known
    req.append_output_token_ids(33)  # sampled: the block's key is final now, that of P + [33]
    assert a.known_blocks() == 2
    assert a.digest(BS, 2 * BS) == request(P + [33])[1].digest(BS, 2 * BS) != last


class _Rows:
    """Per-position inputs (``keys.BlockInputs``): a digest of the range's "rows", one of them
    (``changed``) another row."""

    def __init__(self, changed: int = -1) -> None:
        self.changed = changed

    def digest(self, start: int, end: int) -> bytes:
        return digest16(b"%d:%d:%d" % (start, end, start <= self.changed < end))


def test_the_next_positions_own_inputs_are_in_a_full_blocks_digest():
    """An embedding row (or an image) at the position after a block is the drafter's input there,
    as the token id is: another row there is another key for the block, and nothing before it."""
    req = Request("rows", P + X, SamplingParams(max_tokens=8), None)
    same, other = DraftInputs(req, _Rows(), BS, 1), DraftInputs(req, _Rows(changed=len(P)), BS, 1)
    assert same.digest(0, BS) == other.digest(0, BS)
    assert same.digest(BS, 2 * BS) != other.digest(BS, 2 * BS)


def test_a_resumed_request_knows_the_token_after_its_prompt():
    """A preempted request looked up again holds its output tokens: its prompt's last block has its
    key, that of the prompt and the first output token."""
    _, resumed = request(P, outputs=[41, 42])
    assert resumed.digest(BS, 2 * BS) == request(P + [41])[1].digest(BS, 2 * BS)


def test_a_lookahead_of_n_tokens_keys_a_block_on_all_of_them_and_keeps_no_tails():
    """A multi-module MTP's KV at p depends on tokens up to p + N: every one of them is in the key,
    and a tail (whose slots before its last depend on tokens after it) is never matched."""
    _, a = request(P + X[:3], lookahead=3)
    _, b = request(P + X[:2] + Y[:1], lookahead=3)
    assert a.digest(0, BS) == b.digest(0, BS)
    assert a.digest(BS, 2 * BS) != b.digest(BS, 2 * BS)
    _, short = request(P + X[:2], lookahead=3)  # P's last block is followed by 2 known tokens of 3
    assert short.known_blocks() == 1 and not short.keeps_tails
    assert short.digest(BS, 2 * BS) not in (a.digest(BS, 2 * BS), b.digest(BS, 2 * BS))
    assert short.digest(len(P), len(P) + 2) != BASE  # its tail: this request's own digest


def test_lookups_serve_a_shared_prefix_up_to_the_block_whose_next_token_differs(store_factory):
    """Through the store, each request's blocks saved as ``_plan_saves`` saves them (the full blocks
    whose next token is known, and the tail): after P+X, P+Y gets P's blocks but its last, and P
    itself the same (its next token is the one it samples), as vLLM's own EAGLE block drop; a
    prompt that goes on as P+X did gets P's blocks, and P+X its own blocks and its tail. A block
    that waited for the token its request sampled is served once that token is known."""
    store, ns = store_factory(), make_namespace()

    def save(tokens: list[int], outputs: list[int] = ()) -> None:
        _, extra = request(tokens, outputs)
        epoch, chain = store.chain(ns, np.asarray(tokens, np.uint32), extra)
        final = chain.pick([i for i, n in enumerate(chain.lengths) if i < extra.known_blocks() or n < BS])
        store.save_now(ns, epoch, final, payloads_for(final))

    def served(tokens: list[int]) -> int:
        _, extra = request(tokens)
        return store.lookup(ns, np.asarray(tokens, np.uint32), extra).num_tokens

    save(P + X)
    assert served(P + Y) == served(P) == len(P) - BS
    assert served(P + X[:1] + Y) == len(P)
    assert served(P + X) == len(P + X)
    q = random_tokens("drafts-q", 2 * BS).tolist()
    save(q)  # its prefill: the last block waits for the token the request samples
    assert served(q + [5] + Y) == BS
    save(q, outputs=[5])  # a later step of the request: 5 sampled
    assert served(q + [5] + Y) == len(q) and served(q + [6] + Y) == BS


def test_a_block_whose_draft_kv_is_of_another_token_is_not_stored():
    """vLLM 0.32 writes the draft KV at the end of a prefill chunk that samples nothing from the
    request's last token, not from the next one: the block holding it is not stored, and no block
    the engine's own prefix cache served (below ``local``) is, as such a block may be one."""
    _, a = request(P + X)
    a.note_step(BS // 2)  # a chunk ending mid-block 0
    a.note_step(len(P))  # a chunk ending with block 1 (P's last)
    a.note_step(len(P) + BS + 5)  # the step that finishes the prompt (it samples): nothing
    assert [i for i in range(4) if a.stores(i, 0)] == [2, 3]
    assert [i for i in range(4) if a.stores(i, local=3 * BS)] == [3]


class _Spec:
    """A speculative config as vLLM's ``draft_lookahead`` reads it, with vLLM's own methods."""

    use_eagle = SpeculativeConfig.use_eagle
    use_multi_module_mtp = SpeculativeConfig.use_multi_module_mtp

    def __init__(self, method: str, n: int = 3, mtp_modules: int = 1) -> None:
        self.method, self.num_speculative_tokens = method, n
        self.draft_model_config = SimpleNamespace(hf_config=SimpleNamespace(num_nextn_predict_layers=mtp_modules))


class _Config:
    num_prefill_lookahead_tokens = VllmConfig.num_prefill_lookahead_tokens  # vLLM's property
    num_speculative_tokens = VllmConfig.num_speculative_tokens

    def __init__(self, spec: _Spec | None) -> None:
        self.speculative_config, self.diffusion_config = spec, None


@pytest.mark.parametrize("method, expected", [
    ("eagle", 1), ("eagle3", 1), ("mtp", 1), ("dflash", 1), ("dspark", 1),  # vLLM's use_eagle(): the next token
    ("ngram", 0), ("ngram_gpu", 0), ("suffix", 0), ("draft_model", 0), ("medusa", 0), ("mlp_speculator", 0),
    ("extract_hidden_states", 0),
    ("custom_class", 3),  # unknown: as far as any vLLM drafter reads (num_speculative_tokens)
])
def test_which_drafters_are_keyed_on_later_tokens(method, expected):
    assert draft_lookahead(_Config(_Spec(method))) == expected


def test_a_multi_module_mtp_reads_as_many_tokens_ahead_as_it_drafts_and_no_drafter_reads_none():
    assert draft_lookahead(_Config(_Spec("mtp", n=3, mtp_modules=3))) == 3
    assert draft_lookahead(_Config(None)) == 0
    assert draft_inputs(Request("r", P, SamplingParams(), None), BASE, BS, 0) is BASE  # unchanged
