"""config/values.py: the values a key's text stands for: sizes (``parse_size``), tier shares
(``parse_share``) and tenant names (``check_tenant_name``), each refused with a message that says
what was expected. ``config/schema.py`` applies them to its keys.
"""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Any

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6,
          "mib": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12,
          "tib": 2**40}
_SIZE_RE = re.compile(r"^\s*(\d{1,24}(?:\.\d{1,24})?)\s*([a-zA-Z]{0,3})\s*$")  # bounded digits


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


def parse_share(value: Any) -> float | int:
    """A tier share: a fraction (``0.5`` or ``50%``) of the tier's capacity, or a size (``8GiB``, or a
    byte count of at least 4096)."""
    if isinstance(value, bool):
        raise ValueError("expected a fraction like 0.5 or 50%, or a size like 8GiB")
    if isinstance(value, str) and value.strip().endswith("%"):
        try:
            value = float(Decimal(value.strip()[:-1]) / 100)
        except ArithmeticError:
            raise ValueError("expected a percentage like 50%") from None
    if isinstance(value, float):
        if not 0 <= value <= 1:
            raise ValueError("expected a fraction in [0, 1] of the tier (or a size like 8GiB)")
        return value
    n = parse_size(value)
    if n < 4096:
        raise ValueError(f"a share of {n} bytes; write a fraction as 0.5 or 50% (1.0: the whole tier), "
                         "or a size like 8GiB")
    return n


TENANT_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")  # one spelling per tenant: lower case, no spaces


def check_tenant_name(name: str) -> str:
    """``name`` if it is a tenant's name (``TENANT_NAME``): names that differ only by case or spaces
    would be different tenants (namespaces, holders of shares), so only one spelling is accepted."""
    if not TENANT_NAME.fullmatch(name):
        hint = re.sub(r"\s+", "-", name.strip().lower())
        raise ValueError(f"tenant name {name[:80]!r}: expected 1 to 64 of a-z, 0-9, '.', '_', '-', starting with a "
                         "letter or digit (one spelling: no capitals, no spaces" +
                         (f"; {hint[:80]!r}?)" if TENANT_NAME.fullmatch(hint) else ")"))
    return name


DEFAULT_TENANT = "default"  # the tenant of namespaces whose ``namespace.tenant`` is empty
OTHER_TENANTS = "*"  # in a tier's shares: one share for all the tenants not named there, together


def listed_shares(shares: dict[str, float | int]) -> str:
    """A tier's shares as written: ``'a': 0.5, '*': 1073741824 bytes``."""
    return ", ".join(f"{name[:80]!r}: {s:g}" if isinstance(s, float) else f"{name[:80]!r}: {s} bytes"
                     for name, s in shares.items())
