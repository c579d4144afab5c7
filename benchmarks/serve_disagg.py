"""``python -m benchmarks serve --disagg``: the figures of the prefill/decode configuration.

``disagg`` is one ``kv_producer`` and one ``kv_consumer`` vLLM server on one Redis, with
``kvstrata.tools.pd_router`` in front of them (started by ``serve_engines``, as every
configuration's servers): each request is prefilled by the first with one output token, then
answered by the second. Requests go to the router; the prompt tokens per tier are the decode
server's (what it loaded instead of computing: ``LOADED``; "device" is what its own prefix cache
still held). The comparisons (``ratios``): throughput and TTFT p50 and p90 against the
no-connector server and against one ``kv_both`` server (``strata-remote``, else ``strata-l1l2``),
the fractions of prompt tokens the decode server loaded and computed, printed as references (no
bound), and the share of decode legs that computed nothing but the prompt's last token (bound:
``WHOLE_BOUND``).
"""

from __future__ import annotations

from typing import Any

NAME = "disagg"
# vLLM's cached-prompt-token sources that are kvstrata's tiers (CPU, disk, the shared tier); "device"
# is vLLM's own prefix cache
LOADED = ("host", "disk", "external_unspecified")
# decode legs that found the whole prompt published (the P/D engine test, test_vllm_disagg, asks as much of blocks)
WHOLE_BOUND = 0.95
BOTH = ("strata-remote", "strata-l1l2")  # the kv_both server compared, the first one run


def loaded_fraction(row: dict[str, Any]) -> float | None:
    """The fraction of the run's prompt tokens the server loaded from kvstrata's tiers."""
    if not row.get("prompt_tokens"):
        return None
    return round(sum(row["tokens_per_tier"].get(k, 0) for k in LOADED) / row["prompt_tokens"], 4)


def ratios(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The P/D rows of ``bench serve``'s checks, per concurrency level."""
    out = []
    for r in results:
        if r["config"] != NAME or r["throughput_req_s"] is None:
            continue
        peers = {o["config"]: o for o in results if o["concurrency"] == r["concurrency"] and o["throughput_req_s"]}
        both = next((peers[c] for c in BOTH if c in peers), None)
        for other in filter(None, (peers.get("baseline"), both)):
            for metric, label in (("throughput_req_s", "throughput"), ("ttft_p50_ms", "TTFT p50"),
                                  ("ttft_p90_ms", "TTFT p90")):
                if r[metric] and other[metric]:
                    out.append({"config": NAME, "concurrency": r["concurrency"], "bound": None, "met": None,
                                "target": f"{label} vs {other['config']}",
                                "value": round(r[metric] / other[metric], 3)})
        loaded = loaded_fraction(r)
        if loaded is not None:
            for target, value in (("prompt tokens the decode server loaded", loaded),
                                  ("prompt tokens the decode server computed",
                                   round(r["tokens_recomputed"] / r["prompt_tokens"], 4))):
                out.append({"config": NAME, "concurrency": r["concurrency"], "target": target, "value": value,
                            "bound": None, "met": None})
        if r.get("whole_prompt_hits") is not None:
            whole = r["whole_prompt_hits"]
            out.append({"config": NAME, "concurrency": r["concurrency"], "target": "decode legs that computed only "
                        "the prompt's last token", "value": whole, "bound": WHOLE_BOUND, "met": whole >= WHOLE_BOUND})
    return out
