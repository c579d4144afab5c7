"""metrics.py: the store's telemetry. ``Counters`` (hits per tier, load failures, dropped saves,
evictions, bytes moved), latency samples, and the tier-change listener the engines' KV events hang
on; ``METRICS``, the engine-neutral names under which both adapters export them.

One object, one lock; every component increments through ``inc``. ``snapshot()`` feeds
``kvstrata stats`` and the engines' stats hooks; ``take_samples()`` hands the latency samples
taken since the last call to an engine's histograms; ``register_prometheus()`` exposes the
counters as ``kvstrata_<name>_total`` in a process that runs no engine. Latencies are measured per
call (one ``time.perf_counter`` pair), never per block.

Tier changes: the write and evict paths call ``tier_changed(tier, metas, stored)`` once per batch
of blocks committed to (``stored``) or removed from a tier; a listener set with ``listen`` hears
them (the vLLM adapter turns them into ``BlockStored``/``BlockRemoved`` events). With no listener
the call is one attribute test.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any, Callable, Literal, Mapping, NamedTuple, Sequence

TIERS = ("l1", "l2", "remote")  # the tier names, as the config sections name them
MAX_SAMPLES = 4096  # per histogram and interval: a stalled scraper must not grow memory

CAUSES = ("own_share", "over_share", "lru", "epoch")  # why a block left a tier: ``kvstrata.tenants``
TierListener = Callable[[str, Sequence[Any], bool], None]  # (tier name, EntryMetas, stored)


class MetricDef(NamedTuple):
    """One exported series: ``kvstrata_<name>`` (``_total`` added to counters by the client).

    ``source`` names the counter (or sample series) it is fed from; ``{tier}`` in it makes the
    series carry a ``tier`` label, one child per tier in ``TIERS``, ``{kind}`` a ``kind`` label,
    one child per name in ``kinds``, and ``{cause}`` a ``cause`` label, one per ``CAUSES``.
    ``{tenant}`` (last in the source, after ``@``) makes a ``tenant`` label whose children are made
    as tenants appear (``Children``)."""

    name: str
    kind: Literal["counter", "gauge", "histogram"]
    doc: str
    source: str
    buckets: tuple[float, ...] = ()
    kinds: tuple[str, ...] = ()

    @property
    def per_tier(self) -> bool:
        return "{tier}" in self.source

    @property
    def labels(self) -> list[str]:
        """The labels this series adds to the engine's own."""
        return [label for label in ("tier", "kind", "cause", "tenant") if "{" + label + "}" in self.source]

    def children(self) -> list[tuple[str, tuple[str, ...]]]:
        """(source name, label values) of each child (for ``{tenant}``: the source's prefix)."""
        tiers = TIERS if self.per_tier else ("",)
        kinds = self.kinds if "{kind}" in self.source else ("",)
        causes = CAUSES if "{cause}" in self.source else ("",)
        return [(self.source.format(tier=t, kind=k, cause=c, tenant=""), tuple(v for v in (t, k, c) if v))
                for t in tiers for k in kinds for c in causes]


# the relative error of a verified block: honest recomputations lie below 1e-3 (float32) to 5e-2 (fp8)
_ERROR_BUCKETS = (1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 3e-3, 1e-2, 3e-2, 5e-2, 7e-2, 0.1, 0.3, 1.0, 2.0)
_LATENCY_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

METRICS: tuple[MetricDef, ...] = (
    MetricDef("hit_blocks", "counter", "Blocks served to the engine, by the tier they came from.", "hit_blocks_{tier}"),
    MetricDef("hit_tokens", "counter", "Prompt tokens served to the engine, by the tier they came from.",
              "hit_tokens_{tier}"),
    MetricDef("bytes_read", "counter", "Bytes read from a tier.", "{tier}_bytes_read"),
    MetricDef("bytes_written", "counter", "Bytes written to a tier.", "{tier}_bytes_written"),
    MetricDef("saved_blocks", "counter", "Blocks committed to the store (L1).", "saved_blocks"),
    MetricDef("load_failures", "counter", "Loads that served fewer blocks than found (the engine recomputes).",
              "load_failures"),
    MetricDef("checksum_failures", "counter", "Blocks whose stored bytes failed their checksum.",
              "checksum_failures"),
    MetricDef("auth_failures", "counter", "Values read back from a tier that failed their MAC (forged, or written "
              "under another secret, key, namespace or epoch): blocks, index entries, epochs, descriptors and "
              "announcements (the kind label). Each is a miss.", "{tier}_auth_{kind}",
              kinds=("blocks", "entries", "epochs", "descriptors", "messages")),
    MetricDef("saves_dropped", "counter", "Blocks not saved because the save queue was full.", "saves_dropped"),
    MetricDef("evictions", "counter", "Blocks evicted from a tier for capacity.", "{tier}_evicted"),
    MetricDef("evictions_by_cause", "counter", "Blocks that left a tier, by cause: own_share (the writer was over "
              "its tenant's share, tenants.shares), over_share (another tenant over its share gave it up), lru (no "
              "shares, or no tenant over its share), epoch (an older epoch of its namespace, reclaimed by gc).",
              "{tier}_evicted_{cause}"),
    MetricDef("tenant_bytes", "gauge", "Bytes of a tier's capacity a tenant holds (namespace.tenant; "
              "'default' where empty).", "{tier}_tenant_bytes@{tenant}"),
    MetricDef("tenant_blocks", "gauge", "Blocks of a tier a tenant holds.", "{tier}_tenant_blocks@{tenant}"),
    MetricDef("tenant_share_bytes", "gauge", "The bytes of a tier a tenant keeps against the others "
              "(tenants.shares; 0: none).", "{tier}_tenant_share_bytes@{tenant}"),
    MetricDef("invalidations", "counter", "Namespace invalidations (epoch bumps).", "invalidations"),
    MetricDef("invalidation_failures", "counter", "Invalidations the shared tier refused (the namespace serves "
              "nothing here until the new epoch is written).", "invalidation_failures"),
    MetricDef("unconfirmed_epoch_misses", "counter", "Lookups that missed because the shared tier had not "
              "confirmed the namespace's epoch within remote.invalidation_ms + confirm_margin_ms.",
              "unconfirmed_epoch_misses"),
    MetricDef("not_joined_misses", "counter", "Lookups that missed because another instance reset the namespace "
              "after a weight update and this one has not reset since (it holds other weights): it serves nothing "
              "of the namespace until it resets itself.", "not_joined_misses"),
    MetricDef("not_joined_saves_dropped", "counter", "Blocks not saved (written nowhere) for the same reason.",
              "not_joined_saves"),
    MetricDef("epoch_joins", "counter", "Resets that joined the epoch of another instance's reset instead of starting "
              "a new one.", "epoch_joins"),
    MetricDef("epoch_replays_refused", "counter", "Authenticated epoch values refused because their counter was "
              "below the highest this instance had seen (a value copied earlier and written back): each was replaced "
              "by a fresh epoch.", "epoch_replays_refused"),
    MetricDef("epoch_values_expired", "counter", "Authenticated epoch values refused by an instance with no floor of "
              "its own (a new container) because they were sealed more than remote.epoch_max_age_s ago (a value "
              "written back, or every instance idle that long): each was replaced by a fresh epoch.",
              "epoch_values_expired"),
    MetricDef("namespaces_not_joined", "gauge", "Namespaces this instance has not joined (reset by another instance "
              "since this one last reset): each serves and saves nothing here until this instance resets.",
              "namespaces_not_joined"),
    MetricDef("breaker_trips", "counter", "Times the shared tier's circuit breaker opened.",
              "{tier}_circuit_opened"),
    MetricDef("breaker_recoveries", "counter", "Times the shared tier's circuit breaker closed again (a trial "
              "call succeeded): while breaker_trips exceeds it, the tier is skipped.", "{tier}_circuit_closed"),
    MetricDef("resident_bytes", "gauge", "Bytes a tier holds now.", "{tier}_resident_bytes"),
    MetricDef("resident_blocks", "gauge", "Blocks a tier holds now.", "{tier}_resident_blocks"),
    MetricDef("verify_checks", "counter", "Stored blocks compared with the engine's own computation of their key "
              "(verified hits, verify.sample_rate), by the tier the stored block was read from.", "verify_checks_{tier}"),
    MetricDef("verify_mismatches", "counter", "Verified blocks that differed from the engine's computation beyond the "
              "tolerance of their KV dtype: each was deleted from every tier and logged at ERROR.",
              "verify_mismatches_{tier}"),
    MetricDef("verify_error", "histogram", "The worst relative L2 error of a layer of each verified block (0: equal; "
              "about 1.4: unrelated KV).", "verify_error", _ERROR_BUCKETS),
    MetricDef("verify_skipped", "counter", "Blocks of verified requests left uncompared: their comparison queue was "
              "full (verify.queue_blocks; a slow or hung tier holds it up), or no tier's copy could be read.",
              "verify_skipped"),
    MetricDef("mm_items_unkeyed", "counter", "Multimodal items whose content could not be hashed (their data "
              "not in the EngineCore: vLLM's shm processor cache): their blocks and every block after them are "
              "keyed apart, never shared (vLLM only).", "mm_items_unkeyed"),
    MetricDef("quarantined_misses", "counter", "Lookups that missed because a verified mismatch quarantined the "
              "namespace here (verify.on_mismatch: quarantine) until its epoch changes.", "quarantined_misses"),
    MetricDef("lookup_seconds", "histogram", "Time of one lookup call (all blocks of a prompt).",
              "lookup_seconds", _LATENCY_BUCKETS),
    MetricDef("load_seconds", "histogram", "Time of one load call, by the tier read.", "load_seconds_{tier}",
              _LATENCY_BUCKETS),
    MetricDef("save_queue_wait_seconds", "histogram", "Time a save job waited in the queue before it ran.",
              "save_queue_wait_seconds", _LATENCY_BUCKETS),
)


SOURCES = {source: (m, values) for m in METRICS if "{tenant}" not in m.source for source, values in m.children()}
# counter / sample name -> (the series it feeds, its label values: tier, kind, cause, or none)
PER_TENANT = {prefix: (m, values) for m in METRICS if "{tenant}" in m.source for prefix, values in m.children()}
# ``<prefix>@`` of a per-tenant name (``<prefix>@<tenant>``) -> (the series, its label values before the tenant)


class Children(dict):  # type: ignore[type-arg]
    """Source name -> series child, made up front (``SOURCES``) and, for the per-tenant series, when
    a tenant first appears (``PER_TENANT``)."""

    def __init__(self, series: Mapping[str, Any], labelvalues: Sequence[object]) -> None:
        super().__init__({source: series[m.name].labels(*labelvalues, *values) for source, (m, values) in SOURCES.items()})
        self._series, self._labelvalues = series, tuple(labelvalues)

    def find(self, name: str) -> Any:
        child = self.get(name)
        if child is None and "@" in name:
            prefix, _, tenant = name.partition("@")
            made = PER_TENANT.get(prefix + "@")
            if made is not None and tenant:
                m, values = made
                child = self[name] = self._series[m.name].labels(*self._labelvalues, *values, tenant)
        return child


def kind_of(name: str) -> str | None:
    """The kind of the series ``name`` feeds (None: it feeds none)."""
    made = SOURCES.get(name) or PER_TENANT.get(name.partition("@")[0] + "@")
    return None if made is None else made[0].kind


# ------------------------------------------------------------ engine-neutral export helpers
class Figures(NamedTuple):
    """What a store reports to an engine's metrics in one interval (keys are ``SOURCES`` names;
    names that are not a series are only logged), as ``kvstrata.adapters.figures.FigureCollector``
    makes it from the store's ``figures()``."""

    counters: dict[str, int]  # increments since the last report
    gauges: dict[str, int]  # current values
    samples: dict[str, list[float]]  # latency samples since the last report


def make_series(make: Mapping[str, Callable[..., Any]], labelnames: Sequence[str],
                **gauge_kwargs: Any) -> dict[str, Any]:
    """Every ``METRICS`` series, made by ``make[kind](name=, documentation=, labelnames=, ...)``
    (prometheus_client's signature; an engine passes its own classes). Returns name -> metric."""
    out: dict[str, Any] = {}
    for m in METRICS:
        kwargs: dict[str, Any] = {"name": f"kvstrata_{m.name}", "documentation": m.doc,
                                  "labelnames": [*labelnames, *m.labels]}
        if m.kind == "histogram":
            kwargs["buckets"] = m.buckets
        if m.kind == "gauge":
            kwargs.update(gauge_kwargs)
        out[m.name] = make[m.kind](**kwargs)
    return out


def bind_series(series: Mapping[str, Any], labelvalues: Sequence[object]) -> Children:
    """Source name (``SOURCES``) -> the child of ``series`` it feeds, for one set of label values.
    Children are made up front, so every series shows in a scrape (at 0) before its first event;
    those of a tenant, when the tenant first appears."""
    return Children(series, labelvalues)


def feed_series(children: Children, figures: Figures) -> None:
    """Apply one interval's figures to the children ``bind_series`` made."""
    for name, delta in figures.counters.items():
        child = children.find(name)
        if child is not None and delta > 0 and kind_of(name) == "counter":
            child.inc(delta)
    for name, value in figures.gauges.items():
        child = children.find(name)
        if child is not None and kind_of(name) == "gauge":
            child.set(value)
    for name, values in figures.samples.items():
        child = children.find(name)
        if child is not None and kind_of(name) == "histogram":
            for v in values:
                child.observe(v)


class Counters:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: Counter[str] = Counter()
        self._samples: dict[str, list[float]] = {}
        self._listener: TierListener | None = None

    def inc(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self._values[name] += amount

    def get(self, name: str) -> int:
        with self._lock:
            return self._values[name]

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(sorted(self._values.items()))

    # -------------------------------------------------------------- latencies
    def observe(self, name: str, seconds: float) -> None:
        """One latency sample of ``name`` (a histogram source in ``METRICS``, e.g. ``load_seconds_l2``)."""
        with self._lock:
            samples = self._samples.setdefault(name, [])
            if len(samples) < MAX_SAMPLES:
                samples.append(seconds)

    def take_samples(self) -> dict[str, list[float]]:
        """The samples observed since the last call, by name (and forget them)."""
        with self._lock:
            out, self._samples = self._samples, {}
        return out

    # ----------------------------------------------------------- tier changes
    def listen(self, listener: TierListener | None) -> None:
        """Hear every batch of blocks committed to or removed from a tier (see the module docstring).
        Called on whichever thread changed the tier: the listener must be quick and thread-safe."""
        self._listener = listener

    def tier_changed(self, tier: str, metas: Sequence[Any], stored: bool) -> None:
        listener = self._listener
        if listener is not None and metas:
            listener(tier, metas, stored)

    def register_prometheus(self, registry=None) -> None:  # type: ignore[no-untyped-def]
        """Expose the counters through prometheus-client (optional dependency), for a process that
        runs no engine (inside an engine, the adapters export ``METRICS`` through its endpoint)."""
        from prometheus_client.core import REGISTRY, CounterMetricFamily

        counters = self

        class _Collector:
            def collect(self):  # type: ignore[no-untyped-def]
                for name, value in counters.snapshot().items():
                    yield CounterMetricFamily(f"kvstrata_{name}", f"kvstrata {name}", value=value)

        (registry or REGISTRY).register(_Collector())
