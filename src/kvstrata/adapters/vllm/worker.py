"""The worker side of the vLLM connector: block copies between the KV cache and the L1 arena.

Maps the scheduler's arena (``attach_shared_arena``) at the first step, so the scheduler can unlink
its file, and copies whole blocks between the arena and the KV cache with one batched index
operation per layer (``kvstrata.worker.copy``). A slot holds one vLLM block for all layers of all
tensor-parallel ranks (rank r writes its own region); for an MLA model (``ArenaSpec.shared``) it
holds the one latent every rank has: rank 0 writes it, every rank reads it. With pipeline
parallelism each stage's workers copy their own layers, at the stage's offset within a rank's
region (``ArenaSpec.stage_bytes``), so a slot is laid out as with one stage. After each step it
reports the ops it has finished, keyed by its rank (pipeline stage * TP degree + TP rank:
``StrataWorkerMetadata``); a failed load is
reported both as done (so its pin goes) and through ``get_block_ids_with_load_errors`` (so vLLM
recomputes the blocks).

A hybrid model (several KV cache groups) has one ``BlockLayout`` per group, over that group's
layers: a slot holds one block of one group, and an op names its group. Its loads are
asynchronous: vLLM waits for the request, which is reported through ``get_transfer_results``,
finished, or finished and failed (vLLM then recomputes the whole request).

"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from kvstrata.worker.copy import BlockLayout
from kvstrata.worker.arena import attach_shared_arena

from kvstrata.adapters.vllm.metadata import ArenaSpec, StrataMetadata, StrataStats, StrataWorkerMetadata

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger(__name__)



class WorkerSide:
    """The worker role of ``StrataConnector``, one per tensor-parallel rank: see the module docstring."""

    def __init__(self, vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig") -> None:
        self._num_blocks = kv_cache_config.num_blocks
        self._layouts: list[BlockLayout] = []  # one per KV cache group (one: every layer)
        self._arena: torch.Tensor | None = None
        self._prefault: Any = None  # the arena's Prefaulter for the worker's mapping
        self._arena_path = ""
        self._rank = self._tp_rank = self._stage = 0  # rank: pipeline stage * TP degree + TP rank
        self._saved: set[int] = set()
        self._failed: set[int] = set()
        self._loaded: set[int] = set()
        self._load_errors: set[int] = set()
        self._recving: set[str] = set()  # requests whose asynchronous load finished (failed ones too)
        self._recv_failed: set[str] = set()
        self._sent: set[str] = set()  # kv_producer: requests the scheduler has published (finished_sending)
        self._just_attached = False
        self._load_s: list[float] = []  # one sample per step with loads (the L1-to-KV-cache copy)
        self._bytes_read = 0  # this rank's bytes copied out of L1

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import (get_pp_group, get_tensor_model_parallel_rank,
                                                     get_tensor_model_parallel_world_size)

        self._tp_rank, self._stage = get_tensor_model_parallel_rank(), get_pp_group().rank_in_group
        self._rank = self._stage * get_tensor_model_parallel_world_size() + self._tp_rank  # the scheduler's rank
        self._caches = kv_caches
        log.info("kvstrata worker: %d KV layers, first %s %s", len(kv_caches),
                 next(iter(kv_caches)), tuple(next(iter(kv_caches.values())).shape))

    def _attach(self, spec: ArenaSpec) -> torch.Tensor:
        if self._arena is None or self._arena_path != spec.path:
            stages = spec.stage_bytes or (spec.rank_bytes,)  # this rank's share of a block, per pipeline stage
            base = (0 if spec.shared else self._tp_rank * spec.rank_bytes) + sum(stages[: self._stage])
            groups = spec.groups or [tuple(self._caches)]
            self._layouts = [BlockLayout({n: self._caches[n] for n in names}, self._num_blocks, base_offset=base)
                             for names in groups]
            sizes = [layout.nbytes for layout in self._layouts]
            if max(sizes) != stages[self._stage]:  # a slot's rank region fits the largest group's block
                raise RuntimeError(f"kvstrata: worker blocks are {sizes} bytes per rank, "
                                   f"the scheduler expects {stages[self._stage]}")
            self._arena, self._prefault = attach_shared_arena(spec.path, spec.num_slots, spec.slot_bytes)
            if self._layouts[0].device.type == "cuda":
                torch.cuda.cudart().cudaHostRegister(self._arena.data_ptr(), self._arena.numel(), 0)
            self._arena_path = spec.path
            self._just_attached = True
        return self._arena

    def start_load_kv(self, meta: StrataMetadata) -> None:
        arena = self._attach(meta.arena)  # at the first step, so the scheduler can unlink the file
        self._sent |= meta.finished_sending
        if not meta.loads:
            return
        self._prefault.ahead_of((max((max(op.slots) for op in meta.loads if op.slots), default=0) + 1)
                                * meta.arena.slot_bytes)
        started = time.perf_counter()
        for op in meta.loads:
            try:
                if op.fail:
                    raise RuntimeError("the scheduler could not plan this load")
                self._layouts[op.group].load(op.slots, arena, op.block_ids)
            except Exception:  # an I/O edge: report the blocks (or the request) so vLLM recomputes
                log.exception("kvstrata: load for %s failed; vLLM will recompute it", op.req_id)
                if op.load_async:
                    self._recv_failed.add(op.req_id)
                else:
                    self._load_errors.update(op.block_ids)
            if op.load_async:  # every op of a request comes in one step: it is done after this loop
                self._recving.add(op.req_id)
            # The arena slots are read once load() returns (on CUDA only the GPU scatter of the
            # staged rows is still queued), so the scheduler may unpin them after this step.
            self._loaded.add(op.op_id)
        self._load_s.append(time.perf_counter() - started)
        self._bytes_read += (sum(len(op.slots) for op in meta.loads)
                             * (meta.arena.stage_bytes or (meta.arena.rank_bytes,))[self._stage])

    def wait_for_layer_load(self, layer_name: str) -> None:
        for layout in self._layouts:
            layout.wait_layer(layer_name)

    def wait_for_save(self, meta: StrataMetadata) -> None:
        if not meta.saves or (meta.arena.shared and self._tp_rank != 0):
            return  # a shared latent: TP rank 0 writes it, and the scheduler waits for it alone
        arena = self._attach(meta.arena)
        self._prefault.ahead_of((max((max(op.slots) for op in meta.saves if op.slots), default=0) + 1)
                                * meta.arena.slot_bytes)
        for op in meta.saves:
            try:
                self._layouts[op.group].save(op.block_ids, arena, op.slots)
                self._saved.add(op.op_id)
            except Exception:  # an I/O edge: the blocks are just not stored
                log.exception("kvstrata: save for %s failed; it will not be stored", op.req_id)
                self._failed.add(op.op_id)

    def get_kv_connector_stats(self) -> StrataStats | None:
        if not self._load_s:
            return None
        stats = StrataStats({"counters": {"l1_bytes_read": self._bytes_read}, "samples": {"load_seconds_l1": self._load_s}})
        self._load_s, self._bytes_read = [], 0
        return stats

    def get_transfer_results(self) -> KVConnectorTransferResults:
        """Requests whose asynchronous load is done on this rank (a failed one is in both sets),
        and those a producer's scheduler has published (their blocks can be freed)."""
        done, failed, sent = self._recving, self._recv_failed, self._sent
        self._recving, self._recv_failed, self._sent = set(), set(), set()
        return KVConnectorTransferResults(finished_sending=sent, finished_recving=done, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def build_connector_worker_meta(self) -> StrataWorkerMetadata | None:
        if not (self._saved or self._failed or self._loaded or self._just_attached):
            return None
        rank = self._rank
        meta = StrataWorkerMetadata({rank: self._saved} if self._saved else {},
                                    {rank: self._failed} if self._failed else {},
                                    {rank: self._loaded} if self._loaded else {},
                                    {rank} if self._just_attached else set())
        self._saved, self._failed, self._loaded, self._just_attached = set(), set(), set(), False
        return meta
