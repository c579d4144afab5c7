"""What a store holds, for people and gauges: the namespaces' descriptors and verification records
read back (``descriptors``, ``verify_records``), bytes and blocks resident per tier (``resident``),
what an engine's metrics export (``figures``) and ``stats``."""

from __future__ import annotations

import logging
from dataclasses import asdict
from typing import Callable, Iterable, Mapping, TypeVar

import numpy as np

from kvstrata.epochs.descriptors import decode as decode_descriptor
from kvstrata.keys import Namespace
from kvstrata.store.parts import Parts
from kvstrata.store.protocol import StoreFigures
from kvstrata.store.shares import TenantGauges, tenant_report
from kvstrata.verify.record import Record, decode as decode_record

log = logging.getLogger(__name__)
T = TypeVar("T")


def descriptors(parts: Parts, seeds: Iterable[bytes]) -> dict[bytes, Namespace]:
    """See ``BlockStore.descriptors``."""
    return _read_each(parts, seeds, parts.epochs.descriptor, decode_descriptor, "descriptor", "bad_descriptors")


def verify_records(parts: Parts, seeds: Iterable[bytes]) -> dict[bytes, Record]:
    """The namespaces' verification records (``verify/record.py``: the verified hits of every process
    sharing the epochs)."""
    return _read_each(parts, seeds, parts.epochs.verify_record, lambda raw, _seed: decode_record(raw),
                      "verification record", "bad_verify_records")


def _read_each(parts: Parts, seeds: Iterable[bytes], read: Callable[[bytes], bytes | None],
               decode: Callable[[bytes, bytes], T | None], what: str, counter: str) -> dict[bytes, T]:
    """What ``read`` gives for each namespace, read back as untrusted input: a value that does not
    decode is skipped, logged and counted (``counter``), one that cannot be read is skipped and logged."""
    out: dict[bytes, T] = {}
    for seed in seeds:
        try:
            raw = read(seed)
        except OSError as e:
            log.warning("kvstrata: cannot read the %s of namespace %s: %s", what, seed[:8].hex(), e)
            continue
        if raw is None:
            continue
        value = decode(raw, seed)
        if value is None:
            parts.counters.inc(counter)
            log.warning("kvstrata: ignoring the %s of namespace %s: %d bytes that are not one (damaged, or not "
                        "written by kvstrata)", what, seed[:8].hex(), len(raw))
        else:
            out[seed] = value
    return out


def resident(parts: Parts, tenants: TenantGauges) -> dict[str, int]:
    """See ``BlockStore.resident``."""
    bits = parts.index.tiers_of(slice(None))  # type: ignore[arg-type]
    out: dict[str, int] = {}
    for tier in parts.tiers:
        out[f"{tier.name}_resident_blocks"] = int(np.count_nonzero(bits & tier.bit))
        out[f"{tier.name}_resident_bytes"] = int(tier.used_bytes)
    out["namespaces_not_joined"] = len(parts.epochs.not_joined())
    out.update(tenants.figures(parts, out))  # ``{tier}_tenant_bytes@{tenant}``, ...
    return out


def figures(parts: Parts, tenants: TenantGauges, last: Mapping[str, int] | None) -> StoreFigures:
    """See ``BlockStore.figures``."""
    counters = parts.counters.snapshot()
    samples = parts.counters.take_samples()
    moved = last is None or any(v != last.get(k, 0) for k, v in counters.items())
    return StoreFigures(counters, resident(parts, tenants) if moved else {}, samples)


def stats(parts: Parts) -> dict[str, object]:
    """See ``BlockStore.stats``."""
    census = parts.index.census([t.bit for t in parts.tiers])  # vectorized: seconds saved at millions of blocks
    tiers = {t.name: {"blocks": census.per_tier[t.bit][0], "bytes": census.per_tier[t.bit][1],
                      "capacity_bytes": t.capacity_bytes} for t in parts.tiers}
    spaces: dict[str, dict[str, dict[str, int]]] = {}
    for (seed, epoch), (blocks, nbytes) in sorted(census.per_epoch.items()):
        spaces.setdefault(seed[:8].hex(), {})[f"{epoch:016x}"] = {"blocks": blocks, "bytes": nbytes}
    seeds = sorted(set(census.seeds) | set(parts.epochs.known()))
    current = {s[:8].hex(): f"{parts.epochs.get(s):016x}" for s in seeds}
    found = descriptors(parts, seeds)
    for ns in found.values():  # a process that serves none of them (``kvstrata stats``) learns their tenants
        parts.tenants.learn(ns)
    described = {s[:8].hex(): asdict(ns) for s, ns in found.items()}
    verified = {s[:8].hex(): r.as_dict() for s, r in verify_records(parts, seeds).items()}
    behind = sorted(s[:8].hex() for s in parts.epochs.not_joined())
    return {"tiers": tiers, "namespaces": spaces, "current_epochs": current, "not_joined": behind,
            "descriptors": described, "verified": verified, "tenants": tenant_report(parts),
            "counters": parts.counters.snapshot()}
