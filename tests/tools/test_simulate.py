"""``kvstrata simulate`` against a reference computed independently from the trace."""

from __future__ import annotations

from importlib import resources

from kvstrata.tools.simulate import simulate
from kvstrata.tools.trace import Request, load_trace

SAMPLE = load_trace(resources.files("kvstrata.tools") / "data" / "conversation_sample.jsonl")


def reference_unbounded(trace: list[Request]) -> int:
    """Blocks served by an infinite cache: the longest already-seen prefix of each request."""
    seen: set[tuple[int, ...]] = set()
    served = 0
    for r in trace:
        ids = r.hash_ids
        n = 0
        while n < len(ids) and ids[: n + 1] in seen:
            n += 1
        served += n
        seen.update(ids[: i + 1] for i in range(len(ids)))
    return served


def test_unbounded_cache_matches_the_reference():
    report = simulate(SAMPLE, {"l1": 10**9})
    assert report.tiers[0].served == reference_unbounded(SAMPLE) > 0
    assert report.block_refs == sum(len(r.hash_ids) for r in SAMPLE)


def test_small_l1_loses_hits_that_a_large_l2_recovers():
    unbounded = simulate(SAMPLE, {"l1": 10**9}).tiers[0].served
    small = simulate(SAMPLE, {"l1": 40})
    assert small.tiers[0].served < unbounded
    both = simulate(SAMPLE, {"l1": 40, "l2": 10**9})
    assert both.tiers[1].served > 0  # L2 serves what L1 evicted (and promotes it back)
    assert both.tiers[0].served + both.tiers[1].served == unbounded


def test_lru_keeps_a_hot_prefix():
    hot = [Request(i, 1024, 1, (1, 2)) for i in range(10)]
    cold = [Request(100 + i, 512, 1, (1000 + i,)) for i in range(10)]
    trace = [r for pair in zip(hot, cold) for r in pair]
    report = simulate(trace, {"l1": 3})
    assert report.tiers[0].served == 2 * 9  # the hot 2-block prefix survives every cold insert
