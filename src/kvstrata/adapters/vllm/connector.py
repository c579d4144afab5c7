"""``StrataConnector``: the ``KVConnectorBase_V1`` facade vLLM loads.

vLLM runs one connector instance per role, usually in different processes: the scheduler's in
EngineCore, one per worker beside the KV cache. This class only dispatches each call to the side
its role built (``scheduler.SchedulerSide`` or ``worker.WorkerSide``); calling a method of the
other role is a programming error and raises ``RuntimeError``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvstrata.adapters.logs import follow_engine_logging
from kvstrata.adapters.versions import check_engine_version
from kvstrata.adapters.vllm.backends import report, reported
from kvstrata.adapters.vllm.metadata import StrataMetadata, StrataStats
from kvstrata.adapters.vllm.metrics import StrataPromMetrics
from kvstrata.adapters.vllm.scheduler import SchedulerSide
from kvstrata.adapters.vllm.weights import WeightUpdates
from kvstrata.adapters.vllm.worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class StrataConnector(KVConnectorBase_V1, SupportsHMA):
    """kvstrata as a vLLM v1 KV connector. See the package docstring. ``SupportsHMA``: vLLM keeps
    its hybrid KV cache manager on, and hybrid models get one key chain per KV cache group
    (``hybrid.py``)."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig") -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        follow_engine_logging("vllm")  # kvstrata's lines in vLLM's log, in its format
        if role == KVConnectorRole.SCHEDULER:  # once per engine, in its log
            check_engine_version("vllm", vllm.__version__)
        self._sched = SchedulerSide(vllm_config, kv_cache_config) if role == KVConnectorRole.SCHEDULER else None
        self._worker = WorkerSide(vllm_config, kv_cache_config) if role == KVConnectorRole.WORKER else None

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a save lost to preemption is only a future miss

    def _scheduler_side(self) -> SchedulerSide:
        if self._sched is None:
            raise RuntimeError("kvstrata: a scheduler-side method was called on a worker connector")
        return self._sched

    def _worker_side(self) -> WorkerSide:
        if self._worker is None:
            raise RuntimeError("kvstrata: a worker-side method was called on a scheduler connector")
        return self._worker

    def _metadata(self) -> StrataMetadata:
        meta = self._get_connector_metadata()
        if not isinstance(meta, StrataMetadata):
            raise TypeError(f"kvstrata: connector metadata of type {type(meta).__name__}, expected StrataMetadata")
        return meta

    # scheduler side
    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self._sched is not None:
            self._sched.kv_cache_manager = kv_cache_manager

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler_side().get_num_new_matched_tokens(request, num_computed_tokens)

    def get_external_cache_hit_sources(self, request: "Request", num_external_tokens: int) -> dict[CacheHitSource, int]:
        return self._scheduler_side().get_external_cache_hit_sources(request, num_external_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        self._scheduler_side().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return self._scheduler_side().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        self._scheduler_side().update_connector_output(connector_output)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler_side().request_finished(request, block_ids)

    def request_finished_all_groups(self, request: "Request", block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """HMA's ``request_finished``: saves were made in the steps that computed the blocks."""
        return self._scheduler_side().request_finished(request, list(block_ids[0]) if block_ids else [])

    def reset_cache(self) -> bool | None:
        return self._sched.reset_cache() if self._sched is not None else None

    @property
    def weight_updates(self) -> WeightUpdates | None:
        """The scheduler side's view of weight updates made in memory, for the hook on vLLM's
        ``EngineCore.collective_rpc`` (``weights.py``); None on a worker."""
        return self._sched.weight_updates if self._sched is not None else None

    # the attention backends each worker chose, for the namespace (backends.py)
    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return report(self._vllm_config) if self._worker is not None else None

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
                                             ) -> None:
        """Every worker's report, by (pp rank, tp rank): every stage's, since a block holds every stage's layers."""
        if self._sched is not None:
            self._sched.bind_backends(reported(metadata))

    def take_events(self) -> Iterable["KVCacheEvent"]:
        return self._sched.take_events() if self._sched is not None else ()

    # stats: both sides report (vLLM merges them); see metrics.py for the way to /metrics
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._sched is not None:
            return self._sched.get_kv_connector_stats()
        return self._worker.get_kv_connector_stats() if self._worker is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return StrataStats(data)

    @classmethod
    def build_prom_metrics(cls, vllm_config: "VllmConfig", metric_types: dict[type[PromMetric], type[PromMetricT]],
                           labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
                           ) -> KVConnectorPromMetrics | None:
        return StrataPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker_side().register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        self._worker_side().start_load_kv(self._metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._worker is not None:
            self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return None  # saves copy whole blocks after the forward, in wait_for_save

    def wait_for_save(self) -> None:
        self._worker_side().wait_for_save(self._metadata())

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors() if self._worker is not None else set()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self._worker is None:
            return KVConnectorTransferResults()
        return self._worker.get_transfer_results()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker.build_connector_worker_meta() if self._worker is not None else None

    def shutdown(self) -> None:
        if self._sched is not None:
            self._sched.shutdown()
