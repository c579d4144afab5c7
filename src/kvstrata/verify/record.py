"""verify/record.py: a namespace's verification record, what ``kvstrata stats`` of any process shows
of verified hits (``Record``: checks, mismatches, the last ``Mismatch``; ``encode``, ``decode``).

The figures of verified hits are counted in the engine's process (``store/verify.py``), while
``kvstrata stats`` runs in its own. So each namespace's totals are also kept beside its epoch, as
its descriptor is (``epochs``: ``<epochs folder>/<seed hex>.verify``, ``P:verify:<seed hex>`` in
Redis), where every process sharing the epochs reads them. A process adds what it verified since its
last write to the stored totals (``Record.added``: read, add, write back); two processes writing
the same record at the same moment lose one's addition, a few seconds of its checks at most.
Whether a namespace is quarantined is local to a process and is not recorded.

A record is read back as untrusted input, as a descriptor is (whoever can write the folder or the
Redis can put anything there): ``decode`` answers None for anything but a record of at most
``MAX_BYTES`` whose every field has its type and range; the store counts it
(``bad_verify_records``) and the next write replaces it.
"""

from __future__ import annotations

import json
import math
import string
from typing import Any, NamedTuple

MAX_BYTES = 2048  # a record is about 250 bytes; its strings are bounded below
_VERSION = 1
_MAX_COUNT = (1 << 63) - 1
_MAX_KEY_HEX = 128  # a block key is 16 or 32 bytes
_MAX_TIER = 32


class Mismatch(NamedTuple):
    """The last verified block that differed from the engine's computation."""

    time: float  # time.time() when it was found
    key: str  # the block key, hex, as the ERROR log line names it
    tier: str  # the tier the stored block was read from
    error: float | None  # its worst segment's relative L2 error; None: not finite (NaN or inf in the KV)
    tolerance: float  # the tolerance of its KV dtype
    segment: int  # the segment (layer part) of the worst error


class Record(NamedTuple):
    """One namespace's verification figures: ``checks`` blocks compared, ``mismatches`` of them
    differing, and the ``last`` mismatch."""

    checks: int = 0
    mismatches: int = 0
    last: Mismatch | None = None

    def added(self, other: "Record") -> "Record":
        """Both records' figures together: counts summed, the later of the two last mismatches."""
        last = self.last if other.last is None or (self.last is not None and self.last.time > other.last.time) \
            else other.last
        return Record(min(self.checks + other.checks, _MAX_COUNT),
                      min(self.mismatches + other.mismatches, _MAX_COUNT), last)

    def as_dict(self) -> dict[str, Any]:
        """What ``stats()`` reports (``stats --json``): checks, mismatches, last_mismatch (or None)."""
        return {"checks": self.checks, "mismatches": self.mismatches,
                "last_mismatch": None if self.last is None else self.last._asdict()}


def mismatch(time: float, key: bytes, tier: str, error: float, tolerance: float, segment: int) -> Mismatch:
    """A ``Mismatch`` of a comparison's figures, within what ``decode`` accepts."""
    return Mismatch(time, key.hex()[:_MAX_KEY_HEX], tier[:_MAX_TIER], error if math.isfinite(error) else None,
                    tolerance, segment)


def encode(record: Record) -> bytes:
    """A record as stored: ASCII JSON of at most ``MAX_BYTES``."""
    blob = json.dumps({"kvstrata_verify": _VERSION, **record.as_dict()}, sort_keys=True,
                      separators=(",", ":")).encode("ascii")
    assert len(blob) <= MAX_BYTES, len(blob)
    return blob


def decode(raw: object) -> Record | None:
    """The record a stored value holds, or None unless it is one. Any type, size or content is
    answered, never raised on."""
    if not isinstance(raw, (bytes, bytearray)) or not raw or len(raw) > MAX_BYTES:
        return None
    try:
        data = json.loads(raw, parse_constant=_refuse)  # NaN, Infinity: not ours
    except (ValueError, RecursionError):  # RecursionError: deeply nested arrays
        return None
    if not isinstance(data, dict) or data.get("kvstrata_verify") != _VERSION:
        return None
    checks, mismatches, last = data.get("checks"), data.get("mismatches"), data.get("last_mismatch")
    if not (_count(checks) and _count(mismatches)):
        return None
    if last is None:
        return Record(checks, mismatches, None)
    found = _mismatch(last)
    return None if found is None else Record(checks, mismatches, found)


def _refuse(name: str) -> None:
    raise ValueError(name)


def _count(value: object) -> bool:
    return type(value) is int and 0 <= value <= _MAX_COUNT  # type(): a bool is an int to isinstance


def _number(value: object) -> bool:
    return type(value) in (int, float) and math.isfinite(value)  # type: ignore[arg-type]


def _mismatch(last: object) -> Mismatch | None:
    if not isinstance(last, dict) or set(last) != set(Mismatch._fields):
        return None
    key, tier, error = last["key"], last["tier"], last["error"]
    if not (isinstance(key, str) and 0 < len(key) <= _MAX_KEY_HEX and set(key) <= set(string.hexdigits)):
        return None
    if not (isinstance(tier, str) and 0 < len(tier) <= _MAX_TIER and tier.isascii() and tier.isprintable()):
        return None
    if not (_number(last["time"]) and _number(last["tolerance"]) and (error is None or _number(error))
            and _count(last["segment"])):
        return None
    return Mismatch(float(last["time"]), key, tier, None if error is None else float(error),
                    float(last["tolerance"]), last["segment"])
