"""tiers: the storage media, one module each, behind the ``BlockTier`` interface (``base``).

``memory`` is L1 (slots in one CPU arena, ``arena``), ``disk`` is L2 (one file per block in a
folder, ``folder`` and ``scan``), and the shared L3 is ``sharedfs`` (a shared folder) or ``redis``.
``REMOTE_BACKENDS`` maps ``remote.backend`` to a factory returning the shared tier and the epoch
store it carries (``floor``: a local folder where that store keeps the epochs it saw
replaced, or None). With ``remote.encrypt`` the tier seals its payloads (``format.seal``). With
``tenants.shares.remote`` (``shares``, the tiers' ``tenant_of`` a block's namespace seed) Redis
keeps its key space within ``remote.size`` itself, tenant by tenant (``redis_shares``); the shared
folder's gc ignores them (one LRU over the folder)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from kvstrata.tenants import TierShares

from kvstrata.format.auth import Auth
from kvstrata.format.seal import Seal
from kvstrata.config import RemoteConfig
from kvstrata.epochs.base import EpochStore
from kvstrata.metrics import Counters
from kvstrata.tiers.base import BlockTier
from kvstrata.tiers.disk import DiskTier
from kvstrata.epochs.folder import FileEpochs
from kvstrata.tiers.memory import MemoryTier
from kvstrata.tiers.sharedfs import SharedFsTier

def _seal(cfg: RemoteConfig, auth: Auth | None) -> Seal | None:
    """The AEAD of an encrypted shared tier (``remote.encrypt``; the store refuses it without a secret)."""
    if cfg.encrypt and auth is None:
        raise ValueError("remote.encrypt: true needs a secret (remote.auth_key_file or $KVSTRATA_AUTH_KEY)")
    return Seal(auth) if cfg.encrypt and auth is not None else None


def _redis(counters: Counters, cfg: RemoteConfig, floor: Path | None, auth: Auth | None = None,
           shares: TierShares | None = None, tenant_of: Callable[[bytes], str] | None = None,
           ) -> tuple[BlockTier, EpochStore]:
    from kvstrata.tiers.redis import RedisTier  # redis-py is an optional dependency
    from kvstrata.epochs.redis import RedisEpochs

    tier = RedisTier(counters, cfg, auth=auth, seal=_seal(cfg, auth), shares=shares, tenant_of=tenant_of)
    return tier, RedisEpochs(tier, cfg, floor)


def _fs(counters: Counters, cfg: RemoteConfig, floor: Path | None, auth: Auth | None = None,
        shares: TierShares | None = None, tenant_of: Callable[[bytes], str] | None = None,
        ) -> tuple[BlockTier, EpochStore]:
    tier = SharedFsTier(counters, cfg, auth, _seal(cfg, auth), shares, tenant_of)
    # The group shares the epochs too; every host reads them, so they are confirmed like Redis's.
    bound = None if cfg.allow_stale_epoch else cfg.staleness_bound_s
    return tier, FileEpochs(tier.root / "epochs", tier.modes(), shared=True,
                            refresh_s=cfg.invalidation_ms / 1000, bound_s=bound, auth=auth, counters=counters,
                            counter_prefix="remote", local_floor=floor, max_age_s=cfg.epoch_max_age_s)


REMOTE_BACKENDS: dict[str, Callable[..., tuple[BlockTier, EpochStore]]] = {  # (counters, cfg, floor, auth, shares, tenant_of)
    "redis": _redis,
    "fs": _fs,
}

__all__ = ["REMOTE_BACKENDS", "BlockTier", "DiskTier", "FileEpochs", "MemoryTier", "SharedFsTier"]
