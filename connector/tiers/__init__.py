"""Storage media. ``TIERS`` maps a tier name to its class (L1 memory, L2 disk); ``REMOTE_BACKENDS``
maps ``remote.backend`` to a factory returning the shared tier and the epoch store it carries
(``floor``: a local folder where that store keeps the generations it saw replaced, or None)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from ..config import RemoteConfig
from ..epochs import EpochStore, FileEpochs
from ..metrics import Counters
from .base import BlockTier
from .disk import DiskTier
from .memory import MemoryTier
from .sharedfs import SharedFsTier

TIERS: dict[str, type[BlockTier]] = {MemoryTier.name: MemoryTier, DiskTier.name: DiskTier}


def _redis(counters: Counters, cfg: RemoteConfig, floor: Path | None) -> tuple[BlockTier, EpochStore]:
    from .redis import RedisEpochs, RedisTier  # redis-py is an optional dependency

    tier = RedisTier(counters, cfg)
    return tier, RedisEpochs(tier, cfg, floor)


def _fs(counters: Counters, cfg: RemoteConfig, floor: Path | None) -> tuple[BlockTier, EpochStore]:
    assert cfg.path is not None
    tier = SharedFsTier(counters, cfg)
    return tier, FileEpochs(cfg.path / "epochs", tier.modes())  # the group shares the epochs too


REMOTE_BACKENDS: dict[str, Callable[[Counters, RemoteConfig, Path | None], tuple[BlockTier, EpochStore]]] = {
    "redis": _redis,
    "fs": _fs,
}

__all__ = ["REMOTE_BACKENDS", "TIERS", "BlockTier", "DiskTier", "MemoryTier", "SharedFsTier"]
