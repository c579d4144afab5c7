"""SGLang HiCache storage backend over the kvstrata store (``StrataStorage``).

Loaded with ``--hicache-storage-backend dynamic --hicache-storage-backend-extra-config
@configs/sglang.yaml`` (``module_path: kvstrata.adapters.sglang``, ``class_name: StrataStorage``).

- ``storage``: the ``HiCacheStorage`` backend: key modes, data paths, SGLang's storage metrics.
- ``metrics``: the ``kvstrata_*`` series in SGLang's ``/metrics`` (``--enable-metrics``), and the
  tier each loaded page came from.
- ``pages``: the host pool's pages as byte rows and byte runs (``PageRows``).
- ``namespace``: the extra config, page keys as bytes, and the namespace pages are keyed on.
"""

from __future__ import annotations

from kvstrata.adapters.sglang.namespace import SGLANG_KEYS, digests_of, load_strata_config, namespace_for
from kvstrata.adapters.sglang.pages import LAYOUTS, PageRows
from kvstrata.adapters.sglang.storage import StrataStorage, StrataStorageMetrics

__all__ = ["StrataStorage", "StrataStorageMetrics", "load_strata_config", "SGLANG_KEYS", "PageRows", "LAYOUTS",
           "digests_of", "namespace_for"]
