"""Typed configuration: one YAML file, validated at start-up, with one clear message per mistake.

Where the config comes from, first match wins: an explicit path (the engines' ``config_file``),
then ``$KVSTRATA_CONFIG``, then the embedded default (the defaults of these models, identical to
``configs/default.yaml``). Engines may override single keys with dotted names (``l1.size``).
Errors name the file, the key path, what was expected and the value found.

The file and the engines' override dicts are untrusted input, so every way through is bounded:
the file is read as bytes (a regular file of at most ``MAX_FILE_BYTES``, UTF-8), parsed by a
SafeLoader that stops at ``MAX_DEPTH`` levels, and the file and the overrides may each hold at
most ``MAX_VALUES`` values, a YAML alias counting at every use (a "billion laughs" stops after
``MAX_VALUES`` steps). Messages quote keys and values cut to about ``SHOWN_CHARS`` characters and
list at most ``MAX_ERRORS`` errors. Loading changes nothing on disk: ``l2.path`` is checked (the
nearest existing folder must be writable), not created; sizes are checked against the machine.
"""

from __future__ import annotations

import logging
import os
import re
import reprlib
import stat
from decimal import Decimal
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping

import yaml
from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator,
                      model_validator)

log = logging.getLogger(__name__)

ENV_VAR = "KVSTRATA_CONFIG"
EMBEDDED = "<embedded default>"
MAX_FILE_BYTES = 1 << 20
"""A config file is a few hundred bytes; a larger one is refused before it is parsed."""
MAX_DEPTH = 32
"""Nesting levels, the top mapping being level 1 (kvstrata's own keys go ``OWN_DEPTH`` deep)."""
OWN_DEPTH = 4
MAX_VALUES = 10_000
"""Mappings, lists and scalars in the file, and again in the overrides (about 40 mean something)."""
SHOWN_CHARS = 80
"""A key or value quoted in a message is cut to about this many characters."""
MAX_ERRORS = 20
"""Validation errors listed in one message; the rest are counted."""

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6,
          "mib": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12,
          "tib": 2**40}
_SIZE_RE = re.compile(r"^\s*(\d{1,24}(?:\.\d{1,24})?)\s*([a-zA-Z]{0,3})\s*$")  # bounded digits


class ConfigError(ValueError):
    """A configuration the user has to fix; the message says where and how."""


def parse_size(value: Any) -> int:
    """``8GiB``, ``512MiB``, ``1.5GB`` or a plain integer number of bytes."""
    if isinstance(value, bool):
        raise ValueError("expected a size like 8GiB or a byte count")
    if isinstance(value, int):
        n = value
    elif isinstance(value, str) and (m := _SIZE_RE.match(value)) and m[2].lower() in _UNITS:
        n = int(Decimal(m[1]) * _UNITS[m[2].lower()])  # exact, and no float overflow
    else:
        raise ValueError("expected a size like 8GiB, 512MiB or a byte count")
    if n < 0:
        raise ValueError("expected a non-negative size")
    return n


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
        return None if v is None else _expand_path(v)

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

    @property
    def source(self) -> str:
        """Where this config was read from, for messages. Kept out of ``==`` (it sits beside the
        fields the way a ``cached_property`` does): equal settings are equal wherever they came from."""
        return self.__dict__.get(_SOURCE_KEY, EMBEDDED)


_SOURCE_KEY = "_kvstrata_source"




# ----------------------------------------------------------------------------- reading untrusted input
class _Refused(yaml.YAMLError):
    """Input the loader will not compose; the message is the whole explanation."""


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's SafeLoader (plain data, never Python objects) that stops composing at
    ``MAX_DEPTH`` levels, long before the composer's recursion could reach Python's limit, and at
    ``MAX_VALUES`` nodes, so that a 1 MiB file is not parsed in full (seconds) to be refused after;
    an alias counts once here and at every use in ``check_shape``. A value its constructors cannot
    make (an integer of more than 4300 digits) becomes a marked error."""

    def __init__(self, stream: str, name: str) -> None:
        super().__init__(stream)
        self.name = name  # marks in messages say: in "<file>", line 3, column 9
        self._depth = 0
        self._nodes = 0

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep)
        except ValueError as e:
            raise yaml.constructor.ConstructorError(None, None, f"cannot read this value: {str(e)[:SHOWN_CHARS]}",
                                                    node.start_mark) from None

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth += 1
        self._nodes += 1
        try:
            if self._depth > MAX_DEPTH or self._nodes > MAX_VALUES:
                mark = self.peek_event().start_mark
                what = (f"nested deeper than {MAX_DEPTH} levels" if self._depth > MAX_DEPTH
                        else f"more than {MAX_VALUES} values")
                raise _Refused(f"{what} at line {mark.line + 1}, column {mark.column + 1} "
                               f"(kvstrata's keys go {OWN_DEPTH} deep; a config has about 40 values)")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = SHOWN_CHARS
_REPR.maxlong = SHOWN_CHARS // 2
_REPR.maxlevel = 3
_END = object()


def shown(value: Any) -> str:
    """``repr(value)`` for a message, about ``SHOWN_CHARS`` characters at most whatever the value's
    size or depth (``reprlib`` stops early rather than building the whole text)."""
    text = _REPR.repr(value)
    return text if len(text) <= SHOWN_CHARS + 10 else text[:SHOWN_CHARS] + "..."


def _human(n: int) -> str:
    """``n`` bytes, and in the largest binary unit it reaches: ``1099511627776 bytes (1.0 TiB)``."""
    if n >= 2**100:
        return f"{shown(n)} bytes"
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n} bytes ({n / scale:.1f} {unit})"
    return f"{n} bytes"


def _invalid(*lines: str) -> ConfigError:
    return ConfigError("invalid kvstrata config:\n  " + "\n  ".join(lines))


def check_shape(data: Any, source: str) -> None:
    """Refuse more than ``MAX_VALUES`` values or ``MAX_DEPTH`` levels. The walk is lazy, so it
    stops at the limit however large the input; a shared object (a YAML alias) counts at every
    use, as everything downstream would expand it; a structure that contains itself stops at the
    depth limit."""
    count = 0
    stack = [iter((data,))]  # one iterator per open container: len(stack) is the current level
    while stack:
        node = next(stack[-1], _END)
        if node is _END:
            stack.pop()
            continue
        count += 1
        if count > MAX_VALUES:
            raise _invalid(f"{source}: more than {MAX_VALUES} values (each use of a YAML alias "
                           f"counts); a kvstrata config has about 40")
        if isinstance(node, Mapping):
            children: Any = node.values()
        elif isinstance(node, (list, tuple, set, frozenset)):
            children = node
        else:
            continue
        if len(stack) >= MAX_DEPTH and children:
            raise _invalid(f"{source}: nested deeper than {MAX_DEPTH} levels, or a structure that "
                           f"contains itself (kvstrata's keys go {OWN_DEPTH} deep)")
        stack.append(iter(children))


def _read_text(path: str | os.PathLike[str], source: str) -> str:
    """The file's text: a regular file (opening a FIFO would block) of at most
    ``MAX_FILE_BYTES``, in UTF-8."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except (OSError, ValueError) as e:  # ValueError: a NUL byte in the path
        raise ConfigError(f"cannot read kvstrata config {source}: {getattr(e, 'strerror', None) or e}") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            what = "a folder" if stat.S_ISDIR(info.st_mode) else "not a regular file"
            raise ConfigError(f"cannot read kvstrata config {source}: {what}")
        try:
            raw = f.read(MAX_FILE_BYTES + 1)
        except OSError as e:
            raise ConfigError(f"cannot read kvstrata config {source}: {e.strerror or e}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise _invalid(f"{source}: {_human(max(info.st_size, len(raw)))}, over the "
                       f"{_human(MAX_FILE_BYTES)} limit for a config file")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _invalid(f"{source}: not UTF-8 text (byte {raw[e.start]:#04x} at offset {e.start}); "
                       f"a kvstrata config is a YAML text file") from None


def _parse(text: str, source: str) -> dict[str, Any]:
    """The file's mapping of keys (``{}`` for an empty file, with a note in the log)."""
    loader = _BoundedLoader(text, source)
    try:
        data = loader.get_single_data()
    except _Refused as e:
        raise _invalid(f"{source}: {e}") from None
    except yaml.YAMLError as e:  # PyYAML's marks quote at most a line's snippet; cut anyway
        raise _invalid(f"{source}: not valid YAML: {str(e)[:SHOWN_CHARS * 6]}") from None
    finally:
        loader.dispose()
    if data is None:
        log.warning("kvstrata config %s is empty: using the defaults", source)
        return {}
    if not isinstance(data, dict):
        raise _invalid(f"{source}: <top level>: expected a mapping of keys, got {type(data).__name__}")
    check_shape(data, source)
    return data


def _expand_dotted(overrides: Mapping[str, Any], source: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in overrides.items():
        if not isinstance(key, str) or key.count(".") >= MAX_DEPTH:
            raise _invalid(f"{source}: override {shown(key)}: expected a key name like l1.size")
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise _invalid(f"{source}: override {shown(key)}: {shown(p)} is also given a value")
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
    errors = err.errors(include_url=False)
    lines = []
    for e in errors[:MAX_ERRORS]:
        where = ".".join(p if isinstance(p, str) and len(p) <= SHOWN_CHARS else shown(p)
                         for p in e["loc"]) or "<top level>"
        if e["type"] == "extra_forbidden":
            lines.append(f"{source}: {where}: unknown key")
        else:
            msg = e["msg"].removeprefix("Value error, ")[:SHOWN_CHARS * 3]
            lines.append(f"{source}: {where}: {msg} (got {shown(e['input'])})")
    if len(errors) > MAX_ERRORS:
        lines.append(f"{source}: ... and {len(errors) - MAX_ERRORS} more")
    return "invalid kvstrata config:\n  " + "\n  ".join(lines)


# ----------------------------------------------------------------------------- the machine
def _nearest_existing(path: Path) -> tuple[Path, os.stat_result]:
    """``path`` or its nearest existing ancestor, with its stat (what ``mkdir -p`` would start from)."""
    p = path.absolute()
    while True:
        try:
            return p, os.stat(p)
        except (FileNotFoundError, NotADirectoryError):
            if p.parent == p:
                raise
            p = p.parent


def _check_l2_folder(source: str, cfg: StrataConfig) -> None:
    """``l2.path`` can be created and written, judged without creating or writing anything: its
    nearest existing ancestor must be a writable folder. Warns when ``l2.size`` is larger than
    that folder's whole filesystem."""
    path = cfg.l2.path
    try:
        found, info = _nearest_existing(path)
        if not stat.S_ISDIR(info.st_mode):
            problem = f"{found} is not a folder"
        elif not os.access(found, os.W_OK | os.X_OK):
            problem = f"{found} is not writable"
        else:
            fs = os.statvfs(found)
            problem = ""
    except OSError as e:
        problem = f"{e.filename or path}: {e.strerror or e}"
    if problem:
        raise _invalid(f"{source}: l2.path: expected a writable folder (got {shown(str(path))}: {problem})")
    fs_bytes = fs.f_blocks * fs.f_frsize
    if 0 < fs_bytes < cfg.l2.size:
        log.warning("kvstrata config %s: l2.size: %s is more than the whole filesystem of %s, "
                    "%s: the disk fills up before the tier does", source, _human(cfg.l2.size),
                    found, _human(fs_bytes))


def _memory_bytes() -> int | None:
    """Physical memory (``MemTotal``), or ``None`` where the system does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _check_machine(source: str, cfg: StrataConfig) -> None:
    memory = _memory_bytes()
    if memory and cfg.l1.size > memory:
        raise _invalid(f"{source}: l1.size: {_human(cfg.l1.size)} is more than this machine's "
                       f"memory, {_human(memory)}")
    if cfg.l2.enabled:
        _check_l2_folder(source, cfg)


def check_fits_one_block(cfg: StrataConfig, block_bytes: int) -> None:
    """Raise ConfigError when a tier cannot hold even one block of ``block_bytes`` (the payload
    bytes of one block, known once the engine has laid out its KV cache). Call it before
    allocating anything: the message names the key, its value, the file and the block size."""
    tiers = [("l1.size", cfg.l1.size, "the CPU tier (L1) holds every block on its way in and out")]
    if cfg.l2.enabled:
        tiers.append(("l2.size", cfg.l2.size, "the disk tier (L2) is enabled"))
    if cfg.remote.enabled and cfg.remote.backend == "fs":
        tiers.append(("remote.size", cfg.remote.size, "the shared folder tier is enabled"))
    problems = [f"{cfg.source}: {key}: must hold at least one block of {_human(block_bytes)}, as "
                f"{why} (got {_human(size)})" for key, size, why in tiers if size < block_bytes]
    if problems:
        raise _invalid(*problems)


# ----------------------------------------------------------------------------- entry points
def load_config(path: str | os.PathLike[str] | None = None,
                overrides: Mapping[str, Any] | None = None) -> StrataConfig:
    """Load, merge overrides, validate. Raises ConfigError with a message naming file and key.
    Changes nothing on disk."""
    path = path or os.environ.get(ENV_VAR) or None
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise ConfigError(f"kvstrata config_file: expected a file name (got {shown(path)})")
    source = EMBEDDED if not path else str(path) if len(str(path)) <= 4096 else shown(str(path))
    data: dict[str, Any] = _parse(_read_text(path, source), source) if path else {}
    if overrides:
        source += " (with engine overrides)"
        check_shape(overrides, source)
        data = _merge(data, _expand_dotted(overrides, source))
    try:
        cfg = StrataConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_explain(source, e)) from None
    _check_machine(source, cfg)
    cfg.__dict__[_SOURCE_KEY] = source
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
