"""``python -m benchmarks serve --disagg``: the prefill/decode configuration (issue 30) and its figures.

``disagg`` is one ``kv_producer`` and one ``kv_consumer`` vLLM server on one Redis (each with
every other setting of the bench's servers: block size, device KV cache, batch size, kvstrata's
CPU tier, no disk tier, as ``strata-remote``), started one after the other, with ``kvstrata.tools.pd_router``
in front of them: each request is prefilled by the first with one output token, then answered by
the second. Their shared tier's calls get ``TIMEOUT_MS`` (a decode leg reads a whole prompt from it
in one batch: tens of MB for a long prompt of a real model). Requests go to the router; the prompt
tokens per tier are the decode server's (what it loaded instead of computing: ``LOADED``; "device"
is what its own prefix cache still held). The comparisons (``ratios``): throughput and TTFT p50
and p90 against the no-connector server and against one ``kv_both`` server (``strata-remote``,
else ``strata-l1l2``), the fractions of prompt tokens the decode server loaded and computed,
printed as references (the issue sets no bound), and the share of decode legs that computed
nothing but the prompt's last token (bound: ``WHOLE_BOUND``).
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

from tests.harness.redis_server import redis_server
from kvstrata.tools.serving import Server, free_port, vllm_command
from benchmarks import ttft
from benchmarks.serve_engines import Endpoint, Settings, common_env, strata_yaml, vllm_flags

NAME = "disagg"
# vLLM's cached-prompt-token sources that are kvstrata's tiers (CPU, disk, the shared tier); "device"
# is vLLM's own prefix cache
LOADED = ("host", "disk", "external_unspecified")
WHOLE_BOUND = 0.95  # decode legs that found the whole prompt published (the test asks 95% of blocks)
TIMEOUT_MS = 2000  # the shared tier's call timeout in the pair's YAML (default 200)
BOTH = ("strata-remote", "strata-l1l2")  # the kv_both server compared, the first one run


def launch(s: Settings, folder: Path, stack: contextlib.ExitStack) -> Endpoint:
    """Redis, the two servers (started at once) and the router; all stopped by ``stack``."""
    url = stack.enter_context(redis_server(s.redis_url, folder / "redis"))
    servers = []
    for role in ("kv_producer", "kv_consumer"):
        yaml = strata_yaml(folder / f"{role}.yaml", s, folder, url)
        yaml.write_text(yaml.read_text().replace("remote:\n", f"remote:\n  timeout_ms: {TIMEOUT_MS}\n"))
        kv = {**ttft.strata_transfer_config(yaml), "kv_role": role}
        port = free_port()
        servers.append(Server(vllm_command(s.model, port, kv, block_size=s.block_tokens, extra=vllm_flags(s)),
                              folder / f"{role}.log", port, env=common_env(s), timeout=s.start_timeout))
    for server in servers:  # one after the other: two engines starting at once on a small CPU time
        stack.enter_context(server)  # out the shared tier's calls, and its breaker drops the first saves
    prefill, decode = servers
    port = free_port()
    stack.enter_context(Server([sys.executable, "-m", "kvstrata.tools.pd_router", "--port", str(port), "--prefill",
                                prefill.url, "--decode", decode.url, "--timeout", str(s.request_timeout)],
                               folder / "router.log", port, timeout=60, kind=None))
    return Endpoint("vllm", f"http://127.0.0.1:{port}", s.model, s.request_timeout, metrics_url=decode.url)


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
