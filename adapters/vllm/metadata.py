"""The messages between the scheduler side and the workers, and the stats vLLM logs.

Owns the plan of a step (``StrataMetadata``: the arena and the load and save ``CopyOp``s, sent to
every worker, so it must pickle), the workers' per-rank reports (``StrataWorkerMetadata``, merged
across ranks by vLLM with ``aggregate``) and ``StrataStats`` (counter deltas).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats


@dataclass
class ArenaSpec:
    path: str
    num_slots: int
    slot_bytes: int
    rank_bytes: int  # one tensor-parallel rank's region of a slot


@dataclass
class CopyOp:
    op_id: int
    req_id: str
    slots: list[int]
    block_ids: list[int]


@dataclass
class StrataMetadata(KVConnectorMetadata):
    arena: ArenaSpec
    loads: list[CopyOp] = field(default_factory=list)
    saves: list[CopyOp] = field(default_factory=list)


@dataclass
class StrataWorkerMetadata(KVConnectorWorkerMetadata):
    """What the workers report back to the scheduler after a step, per tensor-parallel rank.

    vLLM merges the reports of all ranks of one step with ``aggregate`` before the scheduler sees
    them (``KVOutputAggregator``), so every set is keyed by the rank that reported it: an op is
    settled only when each rank has reported it, because each rank copies its own shard.
    """

    saved: dict[int, set[int]] = field(default_factory=dict)  # rank -> save ops copied to the arena
    failed: dict[int, set[int]] = field(default_factory=dict)  # rank -> save ops whose copy failed
    loaded: dict[int, set[int]] = field(default_factory=dict)  # rank -> load ops done (or failed)
    attached: set[int] = field(default_factory=set)  # ranks that have just mapped the arena

    def aggregate(self, other: "KVConnectorWorkerMetadata") -> "KVConnectorWorkerMetadata":
        if not isinstance(other, StrataWorkerMetadata):
            raise TypeError(f"kvstrata: cannot merge worker metadata of type {type(other).__name__}")
        return StrataWorkerMetadata(_merge(self.saved, other.saved), _merge(self.failed, other.failed),
                                    _merge(self.loaded, other.loaded), self.attached | other.attached)


def _merge(a: dict[int, set[int]], b: dict[int, set[int]]) -> dict[int, set[int]]:
    return {rank: a.get(rank, set()) | b.get(rank, set()) for rank in a.keys() | b.keys()}


class StrataStats(KVConnectorStats):
    """Counter deltas since the last report, shown in vLLM's own stats logs."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        merged = dict(self.data)
        for k, v in other.data.items():
            merged[k] = merged.get(k, 0) + v
        return StrataStats(data=merged)

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())
