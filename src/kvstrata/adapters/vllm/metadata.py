"""The messages between the scheduler side and the workers, and the stats vLLM logs.

Owns the plan of a step (``StrataMetadata``: the arena and the load and save ``CopyOp``s, sent to
every worker, so it must pickle), the workers' per-rank reports (``StrataWorkerMetadata``, merged
across ranks by vLLM with ``aggregate``) and ``StrataStats`` (counter deltas).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats


@dataclass
class ArenaSpec:
    path: str
    num_slots: int
    slot_bytes: int
    rank_bytes: int  # one tensor-parallel rank's region of a slot (every pipeline stage's layers)
    # A hybrid model's KV cache groups (layer names of each; None: one group, every layer): a slot
    # holds one block of one group, the group's layers at the start of the rank's region.
    groups: list[tuple[str, ...]] | None = None
    # MLA: every rank holds the same latent, so a slot is one rank region that every rank reads
    # and rank 0 alone writes (slot_bytes == rank_bytes).
    shared: bool = False
    # Pipeline parallelism: a rank region's bytes on each stage, in stage order (empty: one stage).
    # Stage s writes and reads its own layers at sum(stage_bytes[:s]) within the rank's region, so
    # a slot is laid out as without pipeline parallelism.
    stage_bytes: tuple[int, ...] = ()


@dataclass
class CopyOp:
    op_id: int
    req_id: str
    slots: list[int]
    block_ids: list[int]
    group: int = 0  # the KV cache group whose blocks these are (hybrid models)
    load_async: bool = False  # a load vLLM waits for (reported per request through get_finished)
    fail: bool = False  # a load the scheduler found it cannot do: report the request failed, copy nothing


@dataclass
class StrataMetadata(KVConnectorMetadata):
    arena: ArenaSpec
    loads: list[CopyOp] = field(default_factory=list)
    saves: list[CopyOp] = field(default_factory=list)
    # kv_producer: finished requests whose blocks are published; every worker reports them to vLLM
    # as finished_sending, which frees the blocks vLLM kept for them (roles.Publisher)
    finished_sending: set[str] = field(default_factory=set)


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
    """What the connector reports to vLLM's stats loop: counter deltas since the last report, gauge
    values and latency samples (``kvstrata.metrics`` names them all), from the scheduler side and
    the workers, merged by ``aggregate``. Plain dicts with string keys, so it crosses processes as
    is. vLLM logs ``reduce()`` and hands ``data`` to ``StrataPromMetrics.observe`` for /metrics."""

    def __init__(self, data: dict[str, Any] | None = None) -> None:
        super().__init__(data={"counters": {}, "gauges": {}, "samples": {}, **(data or {})})

    def reset(self) -> None:
        self.data = {"counters": {}, "gauges": {}, "samples": {}}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        counters, gauges = dict(self.data["counters"]), dict(self.data["gauges"])
        samples = {k: list(v) for k, v in self.data["samples"].items()}
        for k, v in other.data.get("counters", {}).items():
            counters[k] = counters.get(k, 0) + v
        gauges.update(other.data.get("gauges", {}))  # the newest value wins
        for k, v in other.data.get("samples", {}).items():
            samples.setdefault(k, []).extend(v)
        return StrataStats({"counters": counters, "gauges": gauges, "samples": samples})

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = dict(self.data["counters"])
        out.update(self.data["gauges"])
        for k, v in self.data["samples"].items():
            out[f"{k}_count"] = len(v)
            out[f"{k}_avg_ms"] = round(1000 * sum(v) / len(v), 3) if v else 0.0
        return out

    def is_empty(self) -> bool:
        return not (self.data["counters"] or self.data["samples"] or self.data["gauges"])
