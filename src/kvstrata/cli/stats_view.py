"""cli/stats_view.py: ``kvstrata stats`` for a person (``render``): sizes in binary units
(``size_text``: ``1.2 GiB``), each namespace named by its model, weights version, KV dtype, layout,
tenant and key scheme (its descriptor, see ``describe``), whether this store has joined its epoch
(see ``joins``; a process that only reads stats always has), what each tenant holds of each tier
(``_tenants``, shown once there are two tenants or shares), its verified hits (``verified_lines``:
checks, mismatches and the last mismatch, of every process sharing the store, from the namespace's
verification record), and the counters that are not zero.

It reads only the dict ``BlockStore.stats()`` returns (what ``stats --json`` prints), so the two
outputs cannot disagree. Namespaces are printed as blocks of lines rather than table columns: a
model path and a layout are long, and a table squeezed into 80 columns would cut them.
"""

from __future__ import annotations

import time
from typing import Any, Mapping

from rich.console import Console
from rich.table import Table
from rich.text import Text

UNBOUNDED = 1 << 60  # a capacity at least this large is "no limit" (the Redis tier's own maxmemory rules)
_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB")
_NO_DESCRIPTOR = "(model unknown: no descriptor; it is written when an engine starts on this namespace)"


def size_text(n: int) -> str:
    """``n`` bytes in the largest binary unit it reaches, one decimal: ``512 B``, ``1.2 GiB``."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in _UNITS:
        value /= 1024
        if value < 1024 or unit == _UNITS[-1]:
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable")


def render(data: Mapping[str, Any], console: Console) -> None:
    est = data.get("estimating")
    if est:
        console.print(Text(f"estimating: the disk tier is still being counted ({est['shard_folders_counted']} of "
                           f"{est['of']} shard folders); about {est['l2_blocks']:,} blocks, "
                           f"{size_text(est['l2_bytes'])} in all. The figures below are what is counted so far.",
                           style="yellow"), soft_wrap=True)
    console.print(_tiers(data["tiers"]))
    tenants = data.get("tenants", {})
    if len({t for held in tenants.values() for t in held}) > 1 or any(
            f["share_bytes"] for held in tenants.values() for f in held.values()):
        console.print(_tenants(tenants))
    described = data.get("descriptors", {})
    current, spaces = data["current_epochs"], data["namespaces"]
    ids = sorted(set(spaces) | set(current),
                 key=lambda ns_id: (ns_id not in described, described.get(ns_id, {}).get("model", ""), ns_id))
    console.print(Text(f"\nnamespaces: {len(ids)}", style="bold"))
    behind = set(data.get("not_joined", ()))
    verified = data.get("verified", {})
    held = {seed[:16] for seed, v in data.get("verify", {}).items() if v.get("quarantined")}  # this process's
    for ns_id in ids:
        lines = _namespace_lines(ns_id, described.get(ns_id), current.get(ns_id), spaces.get(ns_id, {}),
                                 ns_id not in behind)
        lines += verified_lines(verified.get(ns_id), ns_id in held)
        for line in lines:
            console.print(Text(line), soft_wrap=True)  # soft_wrap: a long path stays on one line
    counters = {k: v for k, v in data["counters"].items() if v}
    if counters:
        console.print()
        table = Table(title="counters of this command (an engine's own are in its /metrics)")
        table.add_column("counter")
        table.add_column("value", justify="right")
        for name, value in counters.items():
            table.add_row(Text(name), size_text(value) if "bytes" in name else str(value))
        console.print(table)


def _tiers(tiers: Mapping[str, Mapping[str, int]]) -> Table:
    table = Table(title="kvstrata tiers")
    for col, justify in (("tier", "left"), ("blocks", "right"), ("used", "right"), ("capacity", "right"),
                         ("full", "right")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for name, t in tiers.items():
        cap = t["capacity_bytes"]
        bounded = 0 < cap < UNBOUNDED
        table.add_row(Text(name), str(t["blocks"]), size_text(t["bytes"]),
                      size_text(cap) if bounded else "no limit",
                      f"{100 * t['bytes'] / cap:.0f}%" if bounded else "-")
    return table


def _tenants(tenants: Mapping[str, Mapping[str, Mapping[str, int]]]) -> Table:
    """What each tenant holds of each tier, against its share (``tenants.shares``; docs/tenants.md)."""
    table = Table(title="tenants (namespace.tenant)")
    for col, justify in (("tier", "left"), ("tenant", "left"), ("blocks", "right"), ("used", "right"),
                         ("share", "right")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for tier, held in tenants.items():
        for tenant, f in held.items():
            table.add_row(Text(tier), Text(tenant), str(f["blocks"]), size_text(f["bytes"]),
                          size_text(f["share_bytes"]) if f["share_bytes"] else "-")
    return table


def _blocks(n: int) -> str:
    return f"{n} block" if n == 1 else f"{n} blocks"


def _namespace_lines(ns_id: str, d: Mapping[str, Any] | None, epoch: str | None,
                     epochs: Mapping[str, Mapping[str, int]], joined: bool = True) -> list[str]:
    live = epochs.get(epoch or "", {"blocks": 0, "bytes": 0})
    old = [v for e, v in epochs.items() if e != epoch]
    stored = f"{_blocks(live['blocks'])}, {size_text(live['bytes'])} (epoch {epoch or '-'})"
    if old:
        stored += (f"; {_blocks(sum(v['blocks'] for v in old))}, {size_text(sum(v['bytes'] for v in old))} "
                   "of older epochs, never served again (`kvstrata gc` reclaims them)")
    lines = [f"  {ns_id}  {d['model'] if d else _NO_DESCRIPTOR}", f"    stored     {stored}"]
    if not joined:
        lines.append("    joined     no: another instance reset it after a weight update; this store serves and "
                     "saves none of it until it resets itself")
    if d:
        extra = "".join(f", {k} {v}" for k, v in sorted(d["extra"].items()))
        lines += [f"    weights    {d['model_version']}",
                  f"    dtype      {d['kv_dtype']}",
                  f"    layout     {d['layout']}",
                  f"    tenant     {d['tenant'] or '-'}",
                  f"    keys       {d.get('key_scheme', 'xxh3')}",  # a descriptor from before schemes: xxh3
                  f"    engine     {d['engine']}: {d['block_size']}-token blocks, "
                  f"rank {d['rank']} of {d['world_size']}{extra}"]
    return lines


def verified_lines(record: Mapping[str, Any] | None, quarantined: bool = False) -> list[str]:
    """A namespace's verified hits (``stats()["verified"]``, see ``verify/record.py``): nothing
    before its first check."""
    lines = []
    if record and record["checks"]:
        n, bad = record["checks"], record["mismatches"]
        lines.append(f"    verified   {_blocks(n)} checked against the engine's own computation, "
                     f"{bad} {'mismatch' if bad == 1 else 'mismatches'}")
        last = record.get("last_mismatch")
        if last:
            when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(last["time"]))
            error = "not finite" if last["error"] is None else f"{last['error']:.3g}"
            lines.append(f"    mismatch   last {when}: block {last['key']} from {last['tier']}, error {error} > "
                         f"tolerance {last['tolerance']:.3g} (segment {last['segment']}); deleted")
    if quarantined:
        lines.append("    quarantine this process serves none of it until its epoch changes (verify.on_mismatch)")
    return lines
