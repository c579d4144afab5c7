"""The attention backends vLLM chose for an engine's layers, as its workers report them: a part of
the namespace (``namespace.with_backends``).

vLLM picks a backend per layer when the model is built, in the worker
(``vllm.v1.attention.selector.get_attn_backend``): from the hardware, the kernels installed, the
model, the settings and environment overrides. The backend decides how K and V are laid out and
packed in a block, so blocks of two backends are not interchangeable even where every setting is
equal. The scheduler side, which makes the namespace, never builds the model, so each worker
reports the names of its layers' backends (``report``, the connector's handshake metadata), and
vLLM hands every worker's report to the scheduler's connector before the engine serves its first
request (``EngineCore.__init__``: ``set_xfer_handshake_metadata_pp_aware``; ``reported``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["BackendReport", "report", "reported"]


@dataclass(frozen=True)
class BackendReport(KVConnectorHandshakeMetadata):
    """One worker's attention backends: the sorted names of its layers' backends."""

    backends: tuple[str, ...]


def report(vllm_config: "VllmConfig") -> BackendReport:
    """This worker's report: every layer of the built model that has an attention backend
    (``AttentionLayerBase.get_attn_backend``: attention, MLA, Mamba and other state layers)."""
    names: set[str] = set()
    for layer in vllm_config.compilation_config.static_forward_context.values():
        get = getattr(layer, "get_attn_backend", None)
        if not callable(get):
            continue
        try:
            backend = get()
            name = backend.get_name() if hasattr(backend, "get_name") else f"{backend.__module__}.{backend.__qualname__}"
        except Exception as e:  # a layer kind that cannot say: named by its class, never left out
            name = f"{type(layer).__qualname__}:{type(e).__name__}"
        names.add(str(name))
    return BackendReport(tuple(sorted(names)))


def reported(metadata: Mapping[Any, Any]) -> tuple[str, ...] | None:
    """The backends of every worker that reported (by (pp rank, tp rank)), or None when none did."""
    reports = [m for m in metadata.values() if isinstance(m, BackendReport)]
    if not reports:
        return None
    return tuple(sorted(set().union(*(r.backends for r in reports))))
