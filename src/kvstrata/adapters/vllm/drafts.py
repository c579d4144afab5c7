"""Speculative drafters whose KV at a position depends on later tokens: how many such tokens
(``draft_lookahead``), and the block keys that cover them (``DraftInputs``).

An EAGLE-style head (vLLM's ``SpeculativeConfig.use_eagle()``: eagle, eagle3, mtp, dflash, dspark)
drafts from the target's hidden state at position p and the input embedding of token p + 1: the
proposer shifts the step's input ids by one and puts each request's sampled token at its last
position (``SpecDecodeBaseProposer.set_inputs_first_pass``, v1/spec_decode/llm_base_proposer.py),
and its layers write their KV at p from that. A multi-module MTP reads up to token p + N (vLLM's
``VllmConfig.num_prefill_lookahead_tokens``, which every vLLM consumer must use). The head's
layers share the target's blocks (``namespace.draft_identity`` names the head), so the KV in a block's
last slot depends on the first token of the next block, or, for a prompt that ends with the
block, on the token the request samples. vLLM drops the last matched block of its own prefix hits
for this reason (``drop_eagle_block``).

``DraftInputs`` wraps a request's extra digest (``request_keys``) and folds those tokens into each
full block's digest, so a block's key covers every token its KV was computed from:

- a full block ``[start, end)``: the tokens ``[end, end + lookahead)`` (and, when the request has
  inputs per position, such as embedding rows or images, their digest), once the request knows
  them. Until then the digest is one of this request's own that no save uses: at a lookup, a block
  that the prompt ends with cannot match (a resumed request knows its output tokens: then it
  can); a save waits for a later step (``known_blocks``: ``SchedulerSide._plan_saves``), and a
  request that finishes first leaves that block unsaved (vLLM's hits drop it too);
- a partial tail (the prompt's last, incomplete block) keeps its key: its tokens and the request's
  inputs. A tail matches only a prompt that ends where it ends, and a hit stops one token short of
  a prompt's end (the engine computes the last token for its logits), so the tail's last slot,
  the only one whose draft KV depends on a later token, is always computed again. With a
  lookahead over 1 the slots before it depend on later tokens too: such tails are neither stored
  nor matched (``keeps_tails``);
- a block is not stored when its draft KV was written from another token than the one after it:
  vLLM 0.32 writes the draft KV at the end of a prefill chunk that samples nothing from the
  request's last known token (``note_step``), and such a block may reach a request through vLLM's
  own prefix cache, so neither is stored (``stores``). Verification compares only the blocks a
  request stores, so it skips both.

A drafter this module does not know (``custom_class``, or a method of a later vLLM) may read any
position: it is given the lookahead of the furthest-reading drafter vLLM ships (multi-module MTP:
``num_speculative_tokens``), at least 1. Drafters whose KV depends on no later token, or that have
none: ``NO_LOOKAHEAD``.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from kvstrata.keys import Extra, as_tokens, digest16, extra_at

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

# Methods whose draft KV at a position depends on no later token: no draft KV at all (n-gram,
# suffix), no attention (Medusa's and the MLP speculator's heads on the hidden state), a draft model
# run on the same tokens as the target, or the target's hidden state at each position cached as KV.
NO_LOOKAHEAD = frozenset({"ngram", "ngram_gpu", "suffix", "medusa", "mlp_speculator", "draft_model",
                          "extract_hidden_states"})
_DOMAIN = b"kvstrata/draft-lookahead/v1"


def draft_lookahead(vllm_config: "VllmConfig") -> int:
    """How many tokens after a position the draft layers' KV at that position depends on: 0 without
    speculative decoding or with a method of ``NO_LOOKAHEAD``; vLLM's own figure for EAGLE-style
    heads (1; a multi-module MTP's ``num_speculative_tokens``); for any other method, conservatively
    the furthest any vLLM drafter reads, at least 1."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None or spec.method in NO_LOOKAHEAD:
        return 0
    if spec.use_eagle():
        return max(1, int(getattr(vllm_config, "num_prefill_lookahead_tokens", 1)))
    n = max(1, spec.num_speculative_tokens or 1)
    log.warning("kvstrata: speculative method %r is not known to read no later token: blocks are keyed on the "
                "%d token(s) after them, as EAGLE's are", spec.method, n)
    return n


class DraftInputs:
    """``keys.BlockInputs`` of one request whose draft KV at a position depends on the ``lookahead``
    tokens after it: ``inner`` (the request's own extra digest) and, for a full block, those tokens
    (see the module docstring). Digests are cached per block once final."""

    __slots__ = ("_request", "_inner", "_block_size", "lookahead", "_unknown", "_digests", "_unstored")

    def __init__(self, request: "Request", inner: Extra, block_size: int, lookahead: int) -> None:
        assert lookahead > 0 and block_size > 0
        self._request = request
        self._inner = inner
        self._block_size = block_size
        self.lookahead = lookahead
        self._unknown = os.urandom(16)  # this request's own: no save uses it, no other request matches it
        self._digests: dict[tuple[int, int], bytes] = {}
        self._unstored: set[int] = set()  # blocks whose draft KV the engine wrote from another token (note_step)

    @property
    def keeps_tails(self) -> bool:
        """Whether a partial tail may be stored and matched: only its last slot depends on a later
        token, and a hit never covers that slot."""
        return self.lookahead == 1

    def known_blocks(self) -> int:
        """Full blocks (from the request's first) whose keys are final: the tokens after each are
        known now."""
        return max(0, self._request.num_tokens - self.lookahead) // self._block_size

    def note_step(self, after: int) -> None:
        """The step being planned computes the request up to token ``after``. A prefill chunk that
        ends before the request's known tokens do samples nothing, and vLLM 0.32's drafter (its
        padded batch: ``prepare_next_token_ids_padded``) then writes the draft KV of position
        ``after - 1`` from the request's last known token, not from token ``after``: the block
        holding it is never stored (``stores``), nor, with a lookahead of N, those holding the N
        positions before ``after`` (each reads a token past the chunk)."""
        if 0 < after < self._request.num_tokens:
            bs = self._block_size
            self._unstored.update(range(max(0, after - self.lookahead) // bs, (after - 1) // bs + 1))

    def stores(self, block: int, local: int) -> bool:
        """Whether block ``block`` of the request may be stored: not one whose draft KV the engine
        wrote from another token (``note_step``), nor one the engine's own prefix cache served
        (below ``local`` tokens: the request that computed it stored it under the same key, unless
        it was such a block)."""
        return block >= local // self._block_size and block not in self._unstored

    def digest(self, start: int, end: int) -> bytes:
        if end - start < self._block_size:  # a partial tail
            return extra_at(self._inner, start, end) if self.keeps_tails else self._unknown
        out = self._digests.get((start, end))
        if out is not None:
            return out
        if end + self.lookahead > self._request.num_tokens:
            return self._unknown  # not cached: the tokens after it come later
        ahead = as_tokens(self._request.all_token_ids[end : end + self.lookahead]).tobytes()
        inner = self._inner
        own = b"" if isinstance(inner, bytes) else inner.digest(end, end + self.lookahead)  # their rows or images
        out = digest16(b"%s:%d:%d:" % (_DOMAIN, self.lookahead, len(own)) + extra_at(inner, start, end) + own + ahead)
        self._digests[(start, end)] = out
        return out


def draft_inputs(request: "Request", extra: Extra, block_size: int, lookahead: int) -> Extra:
    """``extra`` as the keys of a request whose drafter reads ``lookahead`` later tokens (unchanged
    for 0)."""
    return DraftInputs(request, extra, block_size, lookahead) if lookahead else extra
