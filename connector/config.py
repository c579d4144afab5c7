"""Typed configuration: one YAML file, validated at start-up, with one clear message per mistake.

Where the config comes from, first match wins: an explicit path (the engines' ``config_file``),
then ``$KVSTRATA_CONFIG``, then the embedded default (the defaults of these models, identical to
``configs/default.yaml``). Engines may override single keys with dotted names (``l1.size``).
Errors name the file, the key path, what was expected and the value found.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping

import yaml
from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator,
                      model_validator)

ENV_VAR = "KVSTRATA_CONFIG"
EMBEDDED = "<embedded default>"

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6,
          "mib": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12,
          "tib": 2**40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


class ConfigError(ValueError):
    """A configuration the user has to fix; the message says where and how."""


def parse_size(value: Any) -> int:
    """``8GiB``, ``512MiB``, ``1.5GB`` or a plain integer number of bytes."""
    if isinstance(value, bool):
        raise ValueError("expected a size like 8GiB or a byte count")
    if isinstance(value, int):
        n = value
    elif isinstance(value, str) and (m := _SIZE_RE.match(value)) and m[2].lower() in _UNITS:
        n = int(float(m[1]) * _UNITS[m[2].lower()])
    else:
        raise ValueError("expected a size like 8GiB, 512MiB or a byte count")
    if n < 0:
        raise ValueError("expected a non-negative size")
    return n


Size = Annotated[int, BeforeValidator(parse_size)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class NamespaceConfig(_Model):
    model_version: str | None = None
    """Explicit weights version. Default: a fingerprint of the model folder's config and files."""
    tenant: str = ""
    """Salt that separates tenants: blocks are never shared across different values."""


class L1Config(_Model):
    size: Size = 4 * 2**30
    """CPU arena size. One preallocated tensor of fixed-size slots (pages touched lazily)."""
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

    @field_validator("path", mode="after")
    @classmethod
    def _expand(cls, v: Path) -> Path:
        return Path(os.path.expandvars(os.path.expanduser(str(v))))


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
    """``fs`` backend: capacity; ``kvstrata gc`` and writers delete least recently used beyond it."""
    key_prefix: str = "kvstrata"
    timeout_ms: int = Field(200, gt=0)
    """Every remote call gives up after this long; the engine then recomputes."""
    invalidation_ms: int = Field(50, gt=0)
    """How often a missed epoch notification is caught up by polling."""
    breaker: BreakerConfig = BreakerConfig()

    @field_validator("url")
    @classmethod
    def _scheme(cls, v: str) -> str:
        if not v.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("expected a redis://, rediss:// or unix:// URL")
        return v

    @field_validator("path", "tls_ca", mode="after")
    @classmethod
    def _expand(cls, v: Path | None) -> Path | None:
        return None if v is None else Path(os.path.expandvars(os.path.expanduser(str(v))))

    @model_validator(mode="after")
    def _fs_needs_path(self) -> "RemoteConfig":
        if self.enabled and self.backend == "fs" and self.path is None:
            raise ValueError("backend fs needs remote.path (the shared folder)")
        return self


class SaveConfig(_Model):
    queue_blocks: int = Field(4096, gt=0)
    """Blocks waiting to be saved; beyond this, saves are dropped and counted, never blocking."""
    threads: int = Field(1, gt=0, le=64)


class DebugConfig(_Model):
    key_bits: int = Field(128, ge=8, le=128, multiple_of=8)
    """Index key width. Test-only: below 128 it forces collisions that validation must reject."""
    l2_write_delay_ms: float = Field(0.0, ge=0)
    """Test-only: sleep this long in every disk write, to show that a slow disk never stalls."""


class StrataConfig(_Model):
    namespace: NamespaceConfig = NamespaceConfig()
    l1: L1Config = L1Config()
    l2: L2Config = L2Config()
    remote: RemoteConfig = RemoteConfig()
    saves: SaveConfig = SaveConfig()
    lease_seconds: float = Field(60.0, gt=0)
    """Pins expire after this long, so a caller that dies never protects blocks forever."""
    testing: DebugConfig = DebugConfig()


def _expand_dotted(overrides: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in overrides.items():
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        if isinstance(value, Mapping) and isinstance(node.get(leaf), dict):
            node[leaf] = _merge(node[leaf], value)
        else:
            node[leaf] = value
    return out


def _merge(base: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _explain(source: str, err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "<top level>"
        if e["type"] == "extra_forbidden":
            lines.append(f"{source}: {where}: unknown key")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            lines.append(f"{source}: {where}: {msg} (got {e['input']!r})")
    return "invalid kvstrata config:\n  " + "\n  ".join(lines)


def _check_writable(source: str, cfg: StrataConfig) -> None:
    if not cfg.l2.enabled:
        return
    path = cfg.l2.path
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise ConfigError(
            f"invalid kvstrata config:\n  {source}: l2.path: expected a writable folder "
            f"(got {str(path)!r}: {e.strerror or e})"
        ) from None


def load_config(path: str | os.PathLike[str] | None = None,
                overrides: Mapping[str, Any] | None = None) -> StrataConfig:
    """Load, merge overrides, validate. Raises ConfigError with a message naming file and key."""
    path = path or os.environ.get(ENV_VAR) or None
    source = str(path) if path else EMBEDDED
    data: Any = {}
    if path:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ConfigError(f"cannot read kvstrata config {source}: {e.strerror or e}") from None
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"invalid kvstrata config:\n  {source}: not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"invalid kvstrata config:\n  {source}: <top level>: expected a mapping "
                              f"of keys, got {type(data).__name__}")
    if overrides:
        data = _merge(data, _expand_dotted(overrides))
        source += " (with engine overrides)"
    try:
        cfg = StrataConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_explain(source, e)) from None
    _check_writable(source, cfg)
    return cfg


def load_engine_config(extra: Mapping[str, Any] | None, engine_keys: frozenset[str] = frozenset()) -> StrataConfig:
    """kvstrata's part of an engine's extra-config dict: ``config_file`` (else ``$KVSTRATA_CONFIG``,
    else the embedded default) with the other keys, dotted or nested, as overrides; the engine's
    own keys are left out. A bad config is logged as one clear line (so it stands out in the
    engine's log) and raised."""
    ours = {k: v for k, v in (extra or {}).items() if k not in engine_keys}
    path = ours.pop("config_file", None)
    try:
        return load_config(path, ours)
    except ConfigError as e:
        logging.getLogger("kvstrata").error("%s", e)
        raise
