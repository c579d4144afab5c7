"""config/schema.py: the typed configuration, ``StrataConfig`` and its sections: every key, its
type, default and bounds, with a docstring per key, and ``ConfigError``; what a value's text stands
for (sizes, shares, tenant names) is ``config/values.py``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from kvstrata.config.values import DEFAULT_TENANT, OTHER_TENANTS, check_tenant_name, listed_shares, parse_share, parse_size

EMBEDDED = "<embedded default>"


class ConfigError(ValueError):
    """A configuration the user has to fix; the message says where and how."""


Size = Annotated[int, BeforeValidator(parse_size)]


def _expand_path(v: Path) -> Path:
    """``~`` and ``$VARS`` expanded; a NUL byte, which no system call accepts, is refused here."""
    if "\0" in str(v):
        raise ValueError("expected a path without NUL bytes")
    return Path(os.path.expandvars(os.path.expanduser(str(v))))


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class NamespaceConfig(_Model):
    model_version: str | None = None
    """Explicit weights version. Default: a fingerprint of the model folder's config and files."""
    tenant: str = ""
    """Salt that separates tenants: blocks are never shared across different values. Empty (the
    tenant ``default``) or a name of ``TENANT_NAME``: lower case, no spaces, so that two spellings
    of one name can never be two tenants."""
    version_group: str | None = None
    """A name for a set of software releases known to give the same KV. Default (unset): the
    engine's release, torch's and transformers' are in the namespace, so an upgrade of any of them
    starts on a cold shared tier. Set: this name stands in for them, and instances of any release
    with the same name share blocks (name another group when a release changes the KV)."""

    @field_validator("tenant")
    @classmethod
    def _tenant_name(cls, v: str) -> str:
        return v if v == "" else check_tenant_name(v)

    @field_validator("version_group")
    @classmethod
    def _group_name(cls, v: str | None) -> str | None:
        if v is not None and not (0 < len(v) <= 128 and v.isprintable()):
            raise ValueError("expected a name of 1 to 128 printable characters")
        return v


class L1Config(_Model):
    size: Size = 4 * 2**30
    """CPU arena size: one tensor of fixed-size slots, allocated once the block size is known (in
    full when pinned or shared with the engine's workers; else the OS backs pages as they are used)."""
    pin_memory: bool = True
    """Page-lock the arena for fast device copies (only when CUDA is present)."""
    stage_inline_bytes: Size = 64 * 2**20
    """A hit on the disk or shared tier up to this size is read into L1 inside the engine's prefix
    lookup (milliseconds, no thread hand-off); a larger one is staged in the background while the
    engine runs other requests, and the engine is asked to look again. 0: always background."""

    @field_validator("size")
    @classmethod
    def _positive(cls, v: int) -> int:
        if v <= 0:
            raise ValueError("expected a positive size (L1 holds every block on its way in)")
        return v


class L2Config(_Model):
    enabled: bool = True
    path: Path = Path("~/.cache/kvstrata")
    """Folder of the disk tier (``~`` and ``$VARS`` are expanded). Created 0700."""
    size: Size = 32 * 2**30
    """Capacity bound; least recently used blocks are deleted beyond it."""
    fsync: bool = False
    """fsync each block before publishing it (survives power loss; slower writes)."""
    write: Literal["through", "on_evict"] = "through"
    """``through``: every saved block is also written to disk in the background.
    ``on_evict``: a block goes to disk only when L1 evicts it."""
    authenticate: bool = False
    """MAC every disk block (and epoch file) under the deployment secret (``remote.auth_key_file``
    or ``$KVSTRATA_AUTH_KEY``), as the shared tier is: for a host where others can write the L2
    folder. Off: L2 is trusted through its file modes (0700/0600)."""
    encrypt: bool = False
    """Encrypt every disk block's payload (AES-256-GCM under a per-namespace key derived from the
    deployment secret; ``kvstrata.format.seal``), which also authenticates it: for a host where
    others can read the L2 folder. Needs a secret, as ``authenticate`` does, and implies it."""

    @field_validator("path", mode="after")
    @classmethod
    def _expand(cls, v: Path) -> Path:
        return _expand_path(v)


class BreakerConfig(_Model):
    failures: int = Field(3, gt=0)
    """Consecutive failed calls that open the circuit: the tier is skipped (misses, dropped saves)."""
    reset_ms: int = Field(1000, gt=0)
    """First retry after this long; doubles on every failed retry, up to ``max_backoff_ms``."""
    max_backoff_ms: int = Field(30000, gt=0)


class RemoteConfig(_Model):
    enabled: bool = False
    backend: Literal["redis", "fs"] = "redis"
    """``redis``: Redis or Valkey, standalone or Cluster. ``fs``: a shared POSIX folder."""
    url: str = "redis://127.0.0.1:6379/0"
    """``redis://`` or ``rediss://`` (TLS); ``user:password@`` for ACL users."""
    cluster: bool = False
    """Use the Redis Cluster protocol (keys spread over slots, one batch per node)."""
    tls_ca: Path | None = None
    """CA bundle to verify the server certificate with ``rediss://``."""
    path: Path | None = None
    """``fs`` backend: the shared folder (NFS, CephFS, JuiceFS, Lustre, ...)."""
    size: Size = 2**40
    """The shared tier's capacity. ``fs`` backend: ``kvstrata gc`` deletes least recently read blocks
    beyond it (tenant by tenant with ``tenants.shares.remote``). ``redis`` backend: used only with ``tenants.shares.remote`` (which needs it set
    explicitly): writers then keep the key space within it, tenant by tenant (docs/tenants.md), and
    Redis' ``maxmemory`` must be above it (plus about 200 bytes of Redis overhead per block).
    Without shares Redis' own ``maxmemory`` bounds the tier."""
    block_ttl_s: int = Field(7 * 86400, ge=0)
    """Redis: every block's keys (payload, index entry, tail set) expire this long after their last
    write (0: never). What makes the recommended ``maxmemory-policy volatile-lru`` work: Redis then
    evicts blocks only, never the keys without a TTL that hold control state (epochs, floor
    records, descriptors, verification records, the tenant account). A block still in use after
    this long is recomputed once and written again."""
    key_prefix: str = "kvstrata"
    timeout_ms: int = Field(200, gt=0)
    """Every remote call gives up after this long; the engine then recomputes."""
    invalidation_ms: int = Field(50, gt=0)
    """How often a missed epoch notification is caught up by polling."""
    confirm_margin_ms: int = Field(200, gt=0)
    """A lookup uses an epoch only if the shared tier confirmed it at most ``invalidation_ms +
    confirm_margin_ms`` before (``staleness_bound_s``); past that, while the tier does not answer,
    lookups miss. The margin lets a slow or failed poll or two go by without costing hits."""
    epoch_max_age_s: int = Field(3600, gt=0)
    """With a secret: how old an epoch value an instance with no floor of its own (a new container,
    an empty L2) accepts, by the time sealed under its MAC. Instances in use seal it again every
    quarter of this, so only a value written back (a replay) or a fleet idle this long is older:
    either starts a fresh epoch (misses). The window left to a replay: a value written back within
    this long of its copy, to an instance with no floor of its own (docs/consistency.md)."""
    allow_stale_epoch: bool = False
    """The lenient policy: keep using the last epoch read, however old, while the shared tier
    is unreachable. It risks serving blocks another instance invalidated meanwhile (a weight
    update, a reset) for as long as the outage lasts."""
    breaker: BreakerConfig = BreakerConfig()
    auth_key_file: Path | None = None
    """A file holding the deployment secret (at least 32 bytes; surrounding whitespace ignored):
    every value read back from the shared tier must carry a MAC under it (``kvstrata.format.auth``).
    Unset: ``$KVSTRATA_AUTH_KEY``, else the shared tier is unauthenticated (a warning at start).
    Deployments (tenants) with different secrets share one Redis or folder without ever serving
    each other's blocks. The secret itself never goes in the YAML."""
    encrypt: bool = False
    """Encrypt every block's payload on the shared tier (AES-256-GCM under a per-tenant key derived
    from the deployment secret, one random nonce per write; ``kvstrata.format.seal``): a Redis dump
    or the shared folder's files then reveal no payload byte. Needs the secret
    (``auth_key_file`` or ``$KVSTRATA_AUTH_KEY``). Index entries stay MAC'd, not encrypted."""

    @property
    def staleness_bound_s(self) -> float:
        """How long after its last confirmation an epoch is still used by lookups."""
        return (self.invalidation_ms + self.confirm_margin_ms) / 1000

    @field_validator("url")
    @classmethod
    def _scheme(cls, v: str) -> str:
        if not v.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("expected a redis://, rediss:// or unix:// URL")
        return v

    @field_validator("path", "tls_ca", mode="after")
    @classmethod
    def _expand(cls, v: Path | None) -> Path | None:
        return None if v is None else _expand_path(v)

    @field_validator("auth_key_file", mode="after")
    @classmethod
    def _key_file(cls, v: Path | None) -> Path | None:
        """Expanded, and read once now so that a missing, unreadable or short secret fails here,
        naming the key (the secret is not kept: the tiers read it again when they open)."""
        if v is None:
            return None
        from kvstrata.format.auth import SecretError, read_secret_file

        v = _expand_path(v)
        try:
            read_secret_file(v)
        except SecretError as e:
            raise ValueError(str(e)) from None
        return v

    @model_validator(mode="after")
    def _fs_needs_path(self) -> "RemoteConfig":
        if self.enabled and self.backend == "fs" and self.path is None:
            raise ValueError("backend fs needs remote.path (the shared folder)")
        return self


class SaveConfig(_Model):
    queue_blocks: int = Field(4096, gt=0)
    """Blocks waiting to be saved; beyond this, saves are dropped and counted, never blocking."""
    threads: int = Field(1, gt=0, le=64)
    publish_wait_ms: int = Field(2000, ge=0)
    """vLLM ``kv_role: kv_producer`` (a prefill instance): when a request finishes, its blocks are
    written to the shared tier before its answer goes out, waiting at most this long; vLLM keeps
    the request's blocks until then (delayed freeing)."""
    consumer: Literal["computed", "all"] = "computed"
    """vLLM ``kv_role: kv_consumer`` (a decode instance): ``computed`` stores only the blocks its
    own forward passes computed (its outputs, and prompt blocks no producer had published), and
    keeps no disk copy of the blocks it loads from the shared tier; ``all`` stores as ``kv_both``."""


KV_DTYPES = ("float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2")  # ``verify.tolerances`` keys


class VerifyConfig(_Model):
    """The ``verify:`` section: verified hits (``kvstrata.verify``). A sampled request that would
    hit is computed by the engine instead, and the blocks it computes are compared with the stored
    blocks of the same keys; a block that differs is deleted (docs/consistency.md "Verified hits")."""

    sample_rate: float = Field(0.001, ge=0, le=1)
    """Fraction of the requests with a hit that are verified (0: never). A verified request costs
    its hit (the engine recomputes the prefix), never a wrong answer."""
    on_mismatch: Literal["delete", "quarantine"] = "delete"
    """``delete``: the mismatching block is deleted from every tier and counted, the namespace goes
    on serving. ``quarantine``: also, this instance serves nothing of the namespace until its
    epoch changes (``kvstrata invalidate``, an engine reset) or the engine restarts."""
    tolerances: dict[Literal["float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"], float] = {}
    """Per KV dtype, the largest relative L2 error of a layer's part of a block that still counts
    as equal (overrides the calibrated defaults, ``verify.compare.TOLERANCES``)."""
    queue_blocks: int = Field(1024, gt=0)
    """Blocks waiting for their comparison (each holds a scratch L1 slot). Comparisons read tiers,
    so they run on a thread of their own, never the engine's; beyond this many waiting (a slow or
    hung tier holds them up) a verification is skipped and counted (``verify_skipped``)."""

    @field_validator("tolerances")
    @classmethod
    def _positive(cls, v: dict[str, float]) -> dict[str, float]:
        bad = {k: t for k, t in v.items() if not 0 < t < 2}
        if bad:
            raise ValueError(f"tolerances must lie in (0, 2) (2 is the error of opposite blocks): {bad}")
        return v


class KeysConfig(_Model):
    """The ``keys:`` section: how block keys are computed (``kvstrata.keys``)."""

    hash: Literal["blake3", "xxh3"] = "blake3"
    """``blake3``: one keyed BLAKE3 call per block gives its key and fingerprint, keyed by the
    deployment secret (``remote.auth_key_file`` or ``$KVSTRATA_AUTH_KEY``) where one is set:
    collision resistant, so a user who chooses prompts cannot make two blocks share a key.
    ``xxh3``: the keys of earlier versions (their caches stay readable); fast, not collision
    resistant, never keyed. Each scheme has namespaces of its own: switching misses everything
    stored under the other."""


Share = Annotated[float | int, BeforeValidator(parse_share)]


class TenantsConfig(_Model):
    """The ``tenants:`` section: fair shares of each tier between tenants (``kvstrata.tenants``,
    docs/tenants.md). A tenant is the ``namespace.tenant`` of the engine that stored a block
    (empty: the tenant ``default``)."""

    shares: dict[Literal["l1", "l2", "remote"], dict[str, Share]] = {}
    """Per tier, per tenant (a name of ``TENANT_NAME``): the part of the tier a tenant keeps against
    the others, as a fraction of the tier's capacity or a size; ``"*"``: one share for all the
    tenants not named, together (one holder: a tenant gains nothing by storing under more names).
    The shares may add up to the tier at most. A tenant may use free room beyond its share; once
    the tier is full, a holder over its share evicts its own blocks first, and a holder within
    its share loses blocks only after every holder over its share has none left to give. Within
    ``"*"`` the tenants not named are one LRU. A tier with no shares is one LRU for all. ``remote``
    on Redis needs ``remote.size``: kvstrata then keeps the key space under it itself; on the
    shared folder ``kvstrata gc``'s sweep applies them."""

    @field_validator("shares")
    @classmethod
    def _fit(cls, v: dict[str, dict[str, float | int]]) -> dict[str, dict[str, float | int]]:
        """Names, and fractions that fit the tier (sizes: ``StrataConfig._shares_fit``)."""
        for tier, shares in v.items():
            for name in shares:
                if name != OTHER_TENANTS:
                    try:
                        check_tenant_name(name)
                    except ValueError as e:
                        raise ValueError(f"{tier}: {e}") from None
            total = sum(s for s in shares.values() if isinstance(s, float))
            if total > 1 + 1e-9:
                raise ValueError(f"{tier}: the fractions ({listed_shares(shares)}) add up to {total:g}, more than the "
                                 "whole tier (1.0)")
        return v


class StrataConfig(_Model):
    namespace: NamespaceConfig = NamespaceConfig()
    keys: KeysConfig = KeysConfig()
    l1: L1Config = L1Config()
    l2: L2Config = L2Config()
    remote: RemoteConfig = RemoteConfig()
    saves: SaveConfig = SaveConfig()
    lease_seconds: float = Field(60.0, gt=0)
    """The shared folder tier (``remote.backend: fs``): ``kvstrata gc`` never deletes a block read
    within this long (a read renews its file's mtime). An index pin held longer than this is
    logged as overdue, and kept: a pin lasts until its holder gives it back or is gone (its lease
    dropped, its process ended), never a deadline that could run out under an engine's copy."""
    verify: VerifyConfig = VerifyConfig()
    tenants: TenantsConfig = TenantsConfig()

    @model_validator(mode="after")
    def _remote_shares(self) -> "StrataConfig":
        """Shares of a Redis shared tier need its capacity: Redis has none of kvstrata's otherwise
        (its own ``maxmemory`` evicts). The shared folder's ``remote.size`` is always kvstrata's."""
        remote = self.remote
        if not self.tenants.shares.get("remote") or not remote.enabled or remote.backend == "fs":
            return self
        if "size" not in remote.model_fields_set:
            raise ValueError("tenants.shares.remote on Redis needs remote.size set: the bytes of the key space "
                             "kvstrata keeps, tenant by tenant (below Redis' maxmemory, which must not evict)")
        return self

    @model_validator(mode="after")
    def _shares_fit(self) -> "StrataConfig":
        """Every enabled tier's shares, fractions and sizes together, fit its capacity: else one
        holder's guarantee would be taken from another's."""
        sizes = {"l1": ("l1.size", self.l1.size), "l2": ("l2.size", self.l2.size if self.l2.enabled else None),
                 "remote": ("remote.size", self.remote.size if self.remote.enabled else None)}
        for tier, shares in self.tenants.shares.items():
            key, capacity = sizes[tier]
            if capacity is None:
                continue
            taken = sum(int(s * capacity) if isinstance(s, float) else s for s in shares.values())
            if taken > capacity:
                raise ValueError(f"tenants.shares.{tier}: the shares ({listed_shares(shares)}) take {taken} bytes, more "
                                 f"than the tier ({key}: {capacity} bytes)")
        return self

    @property
    def source(self) -> str:
        """Where this config was read from, for messages. Kept out of ``==`` (it sits beside the
        fields the way a ``cached_property`` does): equal settings are equal wherever they came from."""
        return self.__dict__.get(_SOURCE_KEY, EMBEDDED)


_SOURCE_KEY = "_kvstrata_source"
