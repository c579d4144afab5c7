"""vLLM v1 KV connector over the kvstrata store (``StrataConnector``).

Load it with ``"kv_connector": "StrataConnector"`` (the ``vllm.general_plugins`` entry point
``register`` makes the name known in every vLLM process) or with
``"kv_connector_module_path": "kvstrata.adapters.vllm"``. The split follows vLLM's own offloading
design: one connector instance per role, usually in different processes.

- ``connector``: the ``KVConnectorBase_V1`` facade; dispatches to the side its role built.
- ``scheduler``: owns the store; lookups, load and save plans; ``hybrid``: its paths for hybrid
  models; ``staging``: disk hits into L1; ``pending``: its requests and copy ops, settled per rank.
- ``worker``: maps the L1 arena and copies whole blocks between it and the KV cache.
- ``metadata``: the step plan sent to workers, their per-rank reports, the stats.
- ``namespace``: what blocks are keyed on; the arena's name in /dev/shm and dead-arena clean-up.
- ``weights``: weight updates made in memory, seen on vLLM's ``EngineCore.collective_rpc``.
"""

from __future__ import annotations

from kvstrata.adapters.vllm.connector import StrataConnector
from kvstrata.adapters.vllm.metadata import StrataMetadata, StrataStats, StrataWorkerMetadata

__all__ = ["CONNECTOR_NAME", "register", "StrataConnector", "StrataMetadata", "StrataWorkerMetadata", "StrataStats"]

CONNECTOR_NAME = "StrataConnector"


def register() -> None:
    """``vllm.general_plugins`` entry point: makes ``"kv_connector": "StrataConnector"`` work."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, __name__, CONNECTOR_NAME)
