"""Storage media. ``TIERS`` maps a tier name to its class (L1 memory, L2 disk, ...)."""

from .base import BlockTier
from .disk import DiskTier
from .memory import MemoryTier

TIERS: dict[str, type[BlockTier]] = {MemoryTier.name: MemoryTier, DiskTier.name: DiskTier}

__all__ = ["TIERS", "BlockTier", "DiskTier", "MemoryTier"]
