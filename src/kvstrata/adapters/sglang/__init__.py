"""SGLang HiCache storage backend over the kvstrata store (``StrataStorage``).

Loaded with ``--hicache-storage-backend dynamic --hicache-storage-backend-extra-config
@configs/sglang.yaml`` (``module_path: kvstrata.adapters.sglang``, ``class_name: StrataStorage``).

- ``storage``: the ``HiCacheStorage`` backend: keys, data paths, SGLang's storage metrics.
- ``metrics``: the ``kvstrata_*`` series in SGLang's ``/metrics`` (``--enable-metrics``).
- ``pages``: the host pool's pages as byte rows and byte runs (``PageRows``).
- ``namespace``: the extra config, page keys as bytes, and the namespace pages are keyed on.
- ``verify``: verified hits (sampled queries, their write-back compared).
- ``weights``: weight updates made in memory (the store's reset).

Only ``storage`` and ``metrics`` import SGLang (loaded on first use of their names), and ``weights``
when ``storage`` hooks its scheduler.
"""

from __future__ import annotations

import importlib
from typing import Any

from kvstrata.adapters.sglang.namespace import SGLANG_KEYS, digests_of, load_strata_config, namespace_for
from kvstrata.adapters.sglang.pages import LAYOUTS, PageRows

_NEEDS_SGLANG = {"StrataStorage": "storage", "StrataStorageMetrics": "storage"}


def __getattr__(name: str) -> Any:
    if name in _NEEDS_SGLANG:
        return getattr(importlib.import_module(f"{__name__}.{_NEEDS_SGLANG[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["StrataStorage", "StrataStorageMetrics", "load_strata_config", "SGLANG_KEYS", "PageRows", "LAYOUTS",
           "digests_of", "namespace_for"]
