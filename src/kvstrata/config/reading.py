"""config/reading.py: reading untrusted config input, bounded every way through: the file
(``read_text``: a regular file of at most ``MAX_FILE_BYTES``, UTF-8), its YAML (``parse``: a
SafeLoader that stops at ``MAX_DEPTH`` levels and ``MAX_VALUES`` values), the engines' dotted
overrides (``expand_dotted``, ``merge``), and the messages about them (``shown``, ``human``,
``invalid``, ``explain``: keys and values cut to about ``SHOWN_CHARS``, at most ``MAX_ERRORS``
errors, a key of ``RENAMED`` given its new name).
"""

from __future__ import annotations

import logging
import os
import reprlib
import stat
from typing import Any, Mapping

import yaml
from pydantic import ValidationError

from kvstrata.config.schema import ConfigError

log = logging.getLogger(__name__)

ENV_VAR = "KVSTRATA_CONFIG"
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
RENAMED = {
    "remote.allow_stale_generation": "remote.allow_stale_epoch",
}
"""Old key path -> new one: a config that still uses the old name is told the new one."""
REMOVED = {
    "testing": "test-only settings (a narrower index key, a slow disk, a planted identity hole) are not "
               "configuration: no deployment needs them, and a hole in the keys must not be one YAML line "
               "away. kvstrata's tests plant them in their own processes (tests/harness/trials.py)",
}
"""Key path -> why it is gone: a config that names it is refused with the reason."""


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


def human(n: int) -> str:
    """``n`` bytes, and in the largest binary unit it reaches: ``1099511627776 bytes (1.0 TiB)``."""
    if n >= 2**100:
        return f"{shown(n)} bytes"
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n} bytes ({n / scale:.1f} {unit})"
    return f"{n} bytes"


def invalid(*lines: str) -> ConfigError:
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
            raise invalid(f"{source}: more than {MAX_VALUES} values (each use of a YAML alias "
                           f"counts); a kvstrata config has about 40")
        if isinstance(node, Mapping):
            children: Any = node.values()
        elif isinstance(node, (list, tuple, set, frozenset)):
            children = node
        else:
            continue
        if len(stack) >= MAX_DEPTH and children:
            raise invalid(f"{source}: nested deeper than {MAX_DEPTH} levels, or a structure that "
                           f"contains itself (kvstrata's keys go {OWN_DEPTH} deep)")
        stack.append(iter(children))


def read_text(path: str | os.PathLike[str], source: str) -> str:
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
        raise invalid(f"{source}: {human(max(info.st_size, len(raw)))}, over the "
                       f"{human(MAX_FILE_BYTES)} limit for a config file")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise invalid(f"{source}: not UTF-8 text (byte {raw[e.start]:#04x} at offset {e.start}); "
                       f"a kvstrata config is a YAML text file") from None


def parse(text: str, source: str) -> dict[str, Any]:
    """The file's mapping of keys (``{}`` for an empty file, with a note in the log)."""
    loader = _BoundedLoader(text, source)
    try:
        data = loader.get_single_data()
    except _Refused as e:
        raise invalid(f"{source}: {e}") from None
    except yaml.YAMLError as e:  # PyYAML's marks quote at most a line's snippet; cut anyway
        raise invalid(f"{source}: not valid YAML: {str(e)[:SHOWN_CHARS * 6]}") from None
    finally:
        loader.dispose()
    if data is None:
        log.warning("kvstrata config %s is empty: using the defaults", source)
        return {}
    if not isinstance(data, dict):
        raise invalid(f"{source}: <top level>: expected a mapping of keys, got {type(data).__name__}")
    check_shape(data, source)
    return data


def expand_dotted(overrides: Mapping[str, Any], source: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in overrides.items():
        if not isinstance(key, str) or key.count(".") >= MAX_DEPTH:
            raise invalid(f"{source}: override {shown(key)}: expected a key name like l1.size")
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise invalid(f"{source}: override {shown(key)}: {shown(p)} is also given a value")
        _put(node, leaf, value)
    return out


def merge(base: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``extra`` laid over it, mappings merged key by key."""
    out = dict(base)
    for key, value in extra.items():
        _put(out, key, value)
    return out


def _put(node: dict[str, Any], key: str, value: Any) -> None:
    """``node[key] = value``, merging into a mapping already there when ``value`` is one too."""
    if isinstance(value, Mapping) and isinstance(node.get(key), Mapping):
        node[key] = merge(node[key], value)
    else:
        node[key] = value


def explain(source: str, err: ValidationError) -> str:
    errors = err.errors(include_url=False)
    lines = []
    for e in errors[:MAX_ERRORS]:
        where = ".".join(p if isinstance(p, str) and len(p) <= SHOWN_CHARS else shown(p)
                         for p in e["loc"]) or "<top level>"
        if e["type"] == "extra_forbidden" and where in REMOVED:
            lines.append(f"{source}: {_named(where, e['input'])}: removed: {REMOVED[where]}")
        elif e["type"] == "extra_forbidden":
            renamed = RENAMED.get(where)
            lines.append(f"{source}: {where}: " + (f"renamed to {renamed}" if renamed else "unknown key"))
        else:
            msg = e["msg"].removeprefix("Value error, ")[:SHOWN_CHARS * 3]
            lines.append(f"{source}: {where}: {msg} (got {shown(e['input'])})")
    if len(errors) > MAX_ERRORS:
        lines.append(f"{source}: ... and {len(errors) - MAX_ERRORS} more")
    return "invalid kvstrata config:\n  " + "\n  ".join(lines)


def _named(where: str, value: Any) -> str:
    """``where`` and the keys given under it: ``testing.identity_hole = 'lora_version'``."""
    if not isinstance(value, Mapping) or not value:
        return f"{where} = {shown(value)}"
    return ", ".join(f"{where}.{shown(k) if not isinstance(k, str) else k[:SHOWN_CHARS]} = {shown(v)}"
                     for k, v in list(value.items())[:MAX_ERRORS])
