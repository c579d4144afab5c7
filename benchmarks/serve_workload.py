"""Trace requests turned into the turns ``python -m benchmarks serve`` sends, and the simulate reference.

A Mooncake hash id (one 512-token block) becomes ``block_tokens`` token ids drawn from the model's
vocabulary (special tokens left out) with the id as the seed: the same id gives the same tokens in
every run and process. Input and output lengths are scaled by ``block_tokens / 512`` and capped
(``max_prompt``, ``max_output``) so that a CPU can serve them; truncation keeps the prefix
structure because it only cuts tails.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np

from kvstrata.tools.simulate import simulate
from kvstrata.tools.trace import TRACE_BLOCK, Request, sample_sessions


class Turn(NamedTuple):
    """One request to send: ``session`` orders it after the earlier turns of its conversation."""

    index: int  # position in the replayed list
    session: int
    arrival_s: float  # trace time from the first replayed request, unscaled
    prompt: list[int]
    max_tokens: int
    hash_ids: tuple[int, ...]  # trace ids of the prompt's full blocks (after truncation)


@dataclass(frozen=True)
class Scaling:
    block_tokens: int = 64
    max_prompt: int = 3072
    max_output: int = 32

    @property
    def factor(self) -> float:
        return self.block_tokens / TRACE_BLOCK

    def prompt_len(self, req: Request) -> int:
        return max(1, min(self.max_prompt, round(req.input_length * self.factor),
                          len(req.hash_ids) * self.block_tokens or 1))

    def output_len(self, req: Request) -> int:
        return max(1, min(self.max_output, round(req.output_length * self.factor)))


def allowed_tokens(vocab: int, special: Sequence[int]) -> np.ndarray:
    return np.setdiff1d(np.arange(vocab, dtype=np.int64), np.asarray(list(special), dtype=np.int64))


def block_tokens(hash_id: int, n: int, allowed: np.ndarray) -> np.ndarray:
    """The ``n`` token ids of trace block ``hash_id``: the same id always gives the same tokens."""
    return allowed[np.random.default_rng([hash_id, 0x5E4E]).integers(0, len(allowed), n)]


def select(trace: list[Request], sessions: int | None, requests: int | None, start: int,
           seed: int = 0) -> list[Request]:
    """``sessions`` whole conversations (seeded), else the plain slice ``[start, start+requests)``."""
    if sessions:
        return sample_sessions(trace, sessions, seed=seed)
    return trace[start:start + (requests or len(trace))]


def build_turns(reqs: list[Request], scaling: Scaling, allowed: np.ndarray) -> list[Turn]:
    names: dict[tuple[int, ...], int] = {}
    t0 = reqs[0].timestamp_ms if reqs else 0
    cache: dict[int, np.ndarray] = {}
    turns = []
    for i, r in enumerate(reqs):
        n = scaling.prompt_len(r)
        ids = r.hash_ids or ((1 << 40) + i,)  # a request without blocks gets a block of its own
        blocks = [cache.setdefault(h, block_tokens(h, scaling.block_tokens, allowed))
                  for h in ids[:-(-n // scaling.block_tokens)]]
        prompt = np.concatenate(blocks)[:n].tolist()
        full = tuple(ids[:n // scaling.block_tokens])
        turns.append(Turn(i, names.setdefault(r.session, len(names)), (r.timestamp_ms - t0) / 1000,
                          prompt, scaling.output_len(r), full))
    return turns


def simulate_reference(turns: list[Turn], block_tokens: int) -> float:
    """Fraction of prompt tokens an unbounded cache serves on these turns (full blocks only),
    through the real index code (``kvstrata.tools.simulate``)."""
    reqs = [Request(0, len(t.prompt), 1, t.hash_ids) for t in turns]
    report = simulate(reqs, {"l1": sum(len(t.hash_ids) for t in turns) + 1})
    served = sum(t.served for t in report.tiers)
    return served * block_tokens / max(1, sum(len(t.prompt) for t in turns))
