"""What a store holds, for people and gauges: the namespaces' descriptors read back
(``descriptors``), bytes and blocks resident per tier (``resident``) and ``stats``."""

from __future__ import annotations

import logging
from dataclasses import asdict
from typing import Iterable

import numpy as np

from kvstrata.epochs.descriptors import decode as decode_descriptor
from kvstrata.keys import Namespace
from kvstrata.store.parts import Parts

log = logging.getLogger(__name__)


def descriptors(p: Parts, seeds: Iterable[bytes]) -> dict[bytes, Namespace]:
    """See ``BlockStore.descriptors``."""
    out: dict[bytes, Namespace] = {}
    for seed in seeds:
        raw = p.epochs.descriptor(seed)
        if raw is None:
            continue
        ns = decode_descriptor(raw, seed)
        if ns is None:
            p.counters.inc("bad_descriptors")
            log.warning("kvstrata: ignoring the descriptor of namespace %s: %d bytes that do not describe "
                        "it (damaged, or not written by kvstrata)", seed[:8].hex(), len(raw))
        else:
            out[seed] = ns
    return out


def resident(p: Parts) -> dict[str, int]:
    """See ``BlockStore.resident``."""
    bits = p.index.tiers_of(slice(None))  # type: ignore[arg-type]
    out: dict[str, int] = {}
    for tier in p.tiers:
        out[f"{tier.name}_resident_blocks"] = int(np.count_nonzero(bits & tier.bit))
        out[f"{tier.name}_resident_bytes"] = int(tier.used_bytes)
    out["namespaces_not_joined"] = len(p.epochs.not_joined())
    return out


def stats(p: Parts) -> dict[str, object]:
    """See ``BlockStore.stats``."""
    census = p.index.census([t.bit for t in p.tiers])  # vectorized: seconds saved at millions of blocks
    tiers = {t.name: {"blocks": census.per_tier[t.bit][0], "bytes": census.per_tier[t.bit][1],
                      "capacity_bytes": t.capacity_bytes} for t in p.tiers}
    spaces: dict[str, dict[str, dict[str, int]]] = {}
    for (seed, epoch), (blocks, nbytes) in sorted(census.per_epoch.items()):
        spaces.setdefault(seed[:8].hex(), {})[f"{epoch:016x}"] = {"blocks": blocks, "bytes": nbytes}
    seeds = sorted(set(census.seeds) | set(p.epochs.known()))
    current = {s[:8].hex(): f"{p.epochs.get(s):016x}" for s in seeds}
    described = {s[:8].hex(): asdict(ns) for s, ns in descriptors(p, seeds).items()}
    behind = sorted(s[:8].hex() for s in p.epochs.not_joined())
    return {"tiers": tiers, "namespaces": spaces, "current_epochs": current, "not_joined": behind,
            "descriptors": described, "counters": p.counters.snapshot()}
