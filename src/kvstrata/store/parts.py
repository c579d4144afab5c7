"""The pieces every part of the store shares, and how they are built from the config.

``Parts`` holds the index, L1, the backing tiers (L2 disk, then the shared tier), the epochs, the
counters, the background save threads, L2's background recovery and the key scheme (``open_keys``:
``keys.hash``, keyed by the deployment secret where one is set). ``open_parts`` builds them;
it reads no block file (``recovery.py`` brings L2's blocks into the index in the background). The
lookup, load, write and evict parts each hold the one ``Parts`` and read
its fields at every call, so that swapping a field (a test sharing another store's epochs) is
seen by all of them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvstrata.format.auth import ENV as AUTH_ENV, SecretError, load_secret, open_auth
from kvstrata.format.seal import Seal
from kvstrata.config import ConfigError, StrataConfig, check_fits_one_block
from kvstrata.epochs.base import EpochStore, MemoryEpochs
from kvstrata.index import BlockIndex
from kvstrata.keys import KeyScheme, key_scheme
from kvstrata.metrics import Counters
from kvstrata.tenants import TenantMap, TierShares, tier_shares
from kvstrata.tiers import REMOTE_BACKENDS, BlockTier, DiskTier, FileEpochs, MemoryTier
from kvstrata.tiers.redis_client import redact_url
from kvstrata.store.quarantine import Quarantine
from kvstrata.store.recovery import Recovery
from kvstrata.store.saver import Saver

log = logging.getLogger(__name__)
_said: set[str] = set()  # shared tiers (their (un)authenticated state) and key schemes this process has logged


@dataclass(slots=True)
class Parts:
    config: StrataConfig
    counters: Counters
    index: BlockIndex
    l1: MemoryTier
    l2: DiskTier | None
    remote: BlockTier | None
    backing: list[BlockTier]  # L2 first, then the shared tier: the order loads try them in
    epochs: EpochStore
    saver: Saver
    recovery: Recovery | None  # L2's blocks coming into the index (None: no L2)
    keys: KeyScheme  # how every key of this store is computed (``keys.hash``)
    quarantine: Quarantine  # namespaces served nothing here after a verified mismatch (``verify.py``)
    tenants: TenantMap  # namespace seed -> tenant, for the tiers' shares (``shares.py``) and metrics
    shares: dict[str, TierShares]  # ``tenants.shares``: the policy of each tier that has shares

    @property
    def tiers(self) -> list[BlockTier]:
        return [self.l1, *self.backing]

    @property
    def l2_written_through(self) -> bool:
        """Whether a committed block is written to L2 at once (else when L1 evicts it)."""
        return self.l2 is not None and self.config.l2.write == "through"


def open_parts(config: StrataConfig, l1_slot_bytes: int, l1_shared_path: str | None, key_bits: int = 128) -> Parts:
    if l1_slot_bytes:
        check_fits_one_block(config, l1_slot_bytes)
    keys = open_keys(config)
    counters = Counters()
    tenants, shares = TenantMap(), tier_shares(config.tenants.shares)
    index = BlockIndex(key_bits=key_bits, lease_s=config.lease_seconds)
    l1 = MemoryTier(counters, config.l1.size, l1_slot_bytes, config.l1.pin_memory, l1_shared_path)
    backing: list[BlockTier] = []
    l2: DiskTier | None = None
    epochs: EpochStore = MemoryEpochs()
    auth = None
    l2_keyed = config.l2.enabled and (config.l2.authenticate or config.l2.encrypt)  # encrypt implies a MAC
    if config.remote.enabled or l2_keyed:
        try:
            auth = open_auth(config.remote.auth_key_file)
        except SecretError as e:
            raise ConfigError(f"kvstrata config {config.source}: remote.auth_key_file: {e}") from None
        needs = [k for k, on in (("l2.encrypt", l2_keyed and config.l2.encrypt), ("l2.authenticate", l2_keyed),
                                 ("remote.encrypt", config.remote.enabled and config.remote.encrypt)) if on]
        if auth is None and needs:
            raise ConfigError(f"kvstrata config {config.source}: {needs[0]}: true needs a secret: set "
                              f"remote.auth_key_file (a file holding it) or ${AUTH_ENV}")
    if config.l2.enabled:
        l2_auth = auth if l2_keyed else None
        l2 = DiskTier(counters, config.l2.path, config.l2.size, config.l2.fsync, auth=l2_auth,
                      seal=Seal(auth) if auth is not None and config.l2.encrypt else None)
        backing.append(l2)
        epochs = FileEpochs(config.l2.path / "epochs", auth=l2_auth, counters=counters, counter_prefix="l2")
    remote: BlockTier | None = None
    if config.remote.enabled:  # the shared tier also holds the epochs every instance obeys
        floor = config.l2.path / "epochs" if config.l2.enabled else None  # the disk remembers
        remote, epochs = REMOTE_BACKENDS[config.remote.backend](
            counters, config.remote, floor, auth, shares.get("remote"), tenants.tenant_of)
        backing.append(remote)
        where = redact_url(config.remote.url) if config.remote.backend == "redis" else str(
            config.remote.path)  # never a password in the log
        if where not in _said and auth is None:
            _said.add(where)
            log.warning("kvstrata remote: the shared tier %s is unauthenticated: whoever can write there decides "
                        "which KV is served (set remote.auth_key_file, or $%s, to a secret of at least 32 bytes)",
                        where, AUTH_ENV)
        elif where not in _said:
            _said.add(where)
            log.info("kvstrata remote: the shared tier %s is authenticated (keyed BLAKE3 under key id %s)%s",
                     where, auth.key_id, ", payloads encrypted (AES-256-GCM)" if config.remote.encrypt else "")
    saver = Saver(config.saves.queue_blocks, config.saves.threads)
    recovery = Recovery(index, l2) if l2 is not None else None
    return Parts(config, counters, index, l1, l2, remote, backing, epochs, saver, recovery, keys, Quarantine(counters),
                 tenants, shares)


def open_keys(config: StrataConfig) -> KeyScheme:
    """The key scheme of ``keys.hash``, keyed by the deployment secret (``remote.auth_key_file``,
    else ``$KVSTRATA_AUTH_KEY``) where one is set, whether or not a tier is authenticated: every
    process that shares blocks holds the same secret, and only those find each other's blocks."""
    try:
        secret = load_secret(config.remote.auth_key_file)
    except SecretError as e:
        raise ConfigError(f"kvstrata config {config.source}: remote.auth_key_file: {e}") from None
    keys = key_scheme(config.keys.hash, secret)
    if keys.describe() not in _said:
        _said.add(keys.describe())
        if keys.collision_resistant:
            log.info("kvstrata: block keys: %s", keys.describe())
        else:
            log.warning("kvstrata: block keys: %s (keys.hash), not collision resistant: a user who chooses "
                        "prompts can search for two blocks with one key and be served the other's KV "
                        "(keys.hash: blake3 is)", keys.describe())
    return keys
