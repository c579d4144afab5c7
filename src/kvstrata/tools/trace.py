"""Mooncake-format request traces turned into token prompts, keeping the sharing structure.

A trace line has ``timestamp`` (ms), ``input_length``, ``output_length`` and ``hash_ids``: one id
per 512-token prefix block; equal ids mean equal blocks. Each id becomes a deterministic block of
``block_tokens`` token ids (same id, same tokens, in every process), and lengths are scaled by
``block_tokens / 512`` so that a CPU can prefill them.
"""

from __future__ import annotations

import json
import random
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

import numpy as np

TRACE_BLOCK = 512


class Request(NamedTuple):
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    @property
    def session(self) -> tuple[int, ...]:
        """Requests that share their first two hash ids belong to one conversation."""
        return self.hash_ids[:2]


def load_trace(path: str | Path) -> list[Request]:
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                out.append(Request(int(r["timestamp"]), int(r["input_length"]), int(r["output_length"]),
                                   tuple(int(h) for h in r["hash_ids"])))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{n}: not a Mooncake trace line ({e})") from None
    return out


def sample_sessions(trace: list[Request], k: int, seed: int = 0, min_turns: int = 2) -> list[Request]:
    """All turns of ``k`` conversations picked with a fixed seed, in trace order."""
    sessions: dict[tuple[int, ...], list[Request]] = defaultdict(list)
    for r in trace:
        sessions[r.session].append(r)
    names = sorted(s for s, turns in sessions.items() if len(turns) >= min_turns)
    random.Random(seed).shuffle(names)
    chosen = set(names[:k])
    return [r for r in trace if r.session in chosen]


def prompt_tokens(req: Request, block_tokens: int, vocab: int = 32000) -> np.ndarray:
    """Token ids of ``req``: one deterministic block per hash id, cut to the scaled length."""
    blocks = [np.random.default_rng(h).integers(10, vocab, block_tokens, dtype=np.uint32)
              for h in req.hash_ids]
    length = max(1, round(req.input_length * block_tokens / TRACE_BLOCK))
    tokens = np.concatenate(blocks) if blocks else np.zeros(0, np.uint32)
    return tokens[:length]


def output_tokens(req: Request, block_tokens: int) -> int:
    return max(1, round(req.output_length * block_tokens / TRACE_BLOCK))
