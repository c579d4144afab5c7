"""Prefill/decode split through the store: a vLLM server with ``kv_role: kv_producer``
(prefill), one with ``kv_consumer`` (decode), one shared tier, and the router
(``kvstrata.tools.pd_router``) in front of them, all real processes.

One pair on a real redis-server serves the first four tests (each under cache salts or prompts of
its own; the last one kills the prefill server); a pair on a shared folder serves the last test.
The no-connector outputs come from the session's ``baseline`` engines (float32: ``DTYPE``). Four
server starts, and a float32 baseline engine unless another test started it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest

from tests.harness import redisutil
from engines.launchers import BS, Baselines, VllmServer, gen, salt
from kvstrata.tools import serving
from kvstrata.tools.client import Completion, acomplete, session

pytestmark = pytest.mark.skipif(redisutil.REDIS is None, reason="redis-server is not installed")

# float32: the tiny model's random bf16 logits are so flat that most greedy steps are near-ties
# (within 0.05), which batch shapes tip either way; in float32 they are rare
DTYPE = "float32"


class RoleServer(VllmServer):
    """``VllmServer`` (the suite's one vLLM server launcher) with kvstrata in ``role``."""

    def __init__(self, model: str, log_path: Path, config: Path, role: str) -> None:
        super().__init__(model, log_path, config, extra=["--dtype", DTYPE])
        at = self.cmd.index("--kv-transfer-config") + 1
        self.cmd[at] = json.dumps({**json.loads(self.cmd[at]), "kv_role": role})

    def counter(self, name: str, tier: str | None = None) -> float:
        """A ``kvstrata_*`` counter of this server's /metrics (summed over labels; one tier's)."""
        total = 0.0
        for line in self.metrics().splitlines():
            if line.startswith(name + "{") and (tier is None or f'tier="{tier}"' in line):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def gauge(self, name: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in self.metrics().splitlines() if line.startswith(name + "{"))

    def kill(self) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=60)


class Pair:
    """A prefill and a decode server on one shared tier, and the router in front of them."""

    def __init__(self, prefill: RoleServer, decode: RoleServer, router: serving.Server) -> None:
        self.prefill, self.decode, self.router = prefill, decode, router

    def send(self, prompts: list[list[int]], salt_: str | None, concurrency: int = 8,
             url: str | None = None, max_tokens: int = 8) -> list[Completion]:
        """Greedy streamed completions of ``prompts`` through the router (or ``url``), at most
        ``concurrency`` in flight, in prompt order."""
        async def go() -> list[Completion]:
            gate = asyncio.Semaphore(concurrency)

            async def one(http: object, prompt: list[int]) -> Completion:
                async with gate:
                    return await acomplete(http, url or self.router.url, self.decode.model, prompt,  # type: ignore[arg-type]
                                           max_tokens, salt_)

            async with session(300) as http:
                return list(await asyncio.gather(*(one(http, p) for p in prompts)))

        return asyncio.run(go())

    def router_stats(self) -> dict:
        return json.loads(serving.request("GET", self.router.url + "/router/stats"))


def pd_configs(tmp: Path, remote: dict[str, str]) -> tuple[Path, Path]:
    """The prefill's YAML (no disk tier: its blocks are for the decode side) and the decode's (a
    disk tier of its own, which must get only the blocks it computes)."""
    # timeout_ms: the two engines start at once on 2 shared cores; Redis calls that time out then
    # open the breaker, and publications made while it is open are dropped (a miss, by design)
    shared = ["remote:", "  enabled: true", "  timeout_ms: 2000", *[f"  {k}: {v}" for k, v in remote.items()]]
    prefill, decode = tmp / "prefill.yaml", tmp / "decode.yaml"
    prefill.write_text("\n".join(["l1:", "  size: 128MiB", "l2:", "  enabled: false", *shared]) + "\n")
    decode.write_text("\n".join(["l1:", "  size: 128MiB", "l2:", f"  path: {tmp / 'decode-l2'}", *shared]) + "\n")
    return prefill, decode


class Pairs:
    """``pairs(backend)``: the module's pair on that shared tier, started on first use; starting
    one stops the other (at most two engine servers up at once on 2 cores)."""

    def __init__(self, model: str, tmp_path_factory: pytest.TempPathFactory) -> None:
        self.model, self.tmp_path_factory = model, tmp_path_factory
        self.current: tuple[str, Pair, contextlib.ExitStack] | None = None

    def __call__(self, backend: str) -> Pair:
        if self.current is not None and self.current[0] == backend:
            return self.current[1]
        self.close()
        tmp = self.tmp_path_factory.mktemp(f"pd-{backend}")
        stack = contextlib.ExitStack()
        try:
            remote = stack.enter_context(redisutil.shared_backend(backend, tmp))
            prefill_cfg, decode_cfg = pd_configs(tmp, remote)
            prefill = RoleServer(self.model, tmp / "prefill.log", prefill_cfg, "kv_producer")
            decode = RoleServer(self.model, tmp / "decode.log", decode_cfg, "kv_consumer")
            _start_together(stack, prefill, decode)
            port = serving.free_port()
            router = serving.Server([sys.executable, "-m", "kvstrata.tools.pd_router", "--port", str(port),
                                     "--prefill", prefill.url, "--decode", decode.url, "--timeout", "120"],
                                    tmp / "router.log", port, kind=None)
            stack.enter_context(router)
        except BaseException:
            stack.close()
            raise
        self.current = (backend, Pair(prefill, decode, router), stack)
        return self.current[1]

    def close(self) -> None:
        if self.current is not None:
            self.current[2].close()
            self.current = None


def _start_together(stack: contextlib.ExitStack, *servers: RoleServer) -> None:
    """Start ``servers`` in parallel threads (each start is minutes on 2 shared cores)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(servers)) as pool:
        futures = [pool.submit(s.start) for s in servers]
    for s in servers:
        stack.callback(s.stop)
    for f in futures:
        f.result()


@pytest.fixture(scope="module")
def pairs(model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pairs]:
    made = Pairs(model, tmp_path_factory)
    yield made
    made.close()


def prompts(seed: int, n: int, lo: int = 200, hi: int = 700) -> list[list[int]]:
    """``n`` prompts of different lengths (most with a partial tail), no prefix in common."""
    rng = random.Random(seed)
    return [[rng.randrange(10, 3000) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


GAP = 1e-3  # logprob lead of a greedy token over the runner-up, with vLLM alone


def alone(baseline: Baselines, prompts: list[list[int]], max_tokens: int = 8) -> list[list[int]]:
    """vLLM alone's greedy tokens of each prompt (the session's no-connector engine in float32),
    up to the first step whose runner-up is within ``GAP``: the random weights have near-ties,
    which a server's other batch shapes can tip either way, with or without kvstrata."""
    engine = baseline.engine(baseline.model, DTYPE)
    outs = engine.run([gen(p, max_tokens=max_tokens, logprobs=2) for p in prompts])
    return [o["tokens"][: next((i for i, top in enumerate(o["top"]) if top[0] - top[1] < GAP), len(o["tokens"]))]
            for o in outs]


def clear_prompts(baseline: Baselines, seed: int, n: int, lo: int, hi: int) -> list[list[int]]:
    """``n`` of ``prompts(seed, 4 * n, lo, hi)`` whose greedy tokens are clear longest with vLLM alone."""
    cands = prompts(seed, 4 * n, lo, hi)
    clear = alone(baseline, cands)
    return [p for _, p in sorted(zip(clear, cands), key=lambda pair: -len(pair[0]))[:n]]


def assert_as_vllm_alone(outs: list[Completion], want: list[list[int]]) -> None:
    """Every output starts with vLLM alone's clear tokens, and those are most of the tokens."""
    assert [o.tokens[: len(w)] for o, w in zip(outs, want)] == want
    assert sum(map(len, want)) >= 0.5 * sum(len(o.tokens) for o in outs), [len(w) for w in want]


def own_blocks(prompt_len: int, max_tokens: int = 8) -> int:
    """Full blocks the decode side completes itself: its forward passes write the KV of the
    prompt's last token and of every output token but the last."""
    return (prompt_len + max_tokens - 1) // BS - prompt_len // BS


def settled(read: Callable[[], float], poke: Callable[[], object] = lambda: None, timeout: float = 60) -> float:
    """``read()`` once two reads 0.5 s apart agree. A server ships kvstrata's figures to /metrics
    with its engine steps, and the save threads write after the step that saved: ``poke`` makes
    the server take a step (a request that changes no counter)."""
    deadline, last = time.monotonic() + timeout, None
    while True:
        time.sleep(0.5)
        poke()
        value = read()
        if value == last or time.monotonic() > deadline:
            return value
        last = value


def test_decode_loads_every_published_block_and_answers_as_vllm_alone(pairs, baseline):
    """Scenario: 24 requests at concurrency 8 through the router. The decode server computes only
    each prompt's last token (every full block and the partial tail are loaded: at least 95% of
    the full blocks is the issue's bound), stores only the blocks it completes itself (no disk
    copy of what it loaded) and answers as vLLM alone; the prefill server frees every block it
    held for its publications."""
    pair = pairs("redis")
    ps, s = prompts(30, 24), salt()
    saved, hit = pair.decode.counter("kvstrata_saved_blocks_total"), pair.decode.counter("kvstrata_hit_tokens_total")
    l2, remote = (pair.decode.counter("kvstrata_bytes_written_total", t) for t in ("l2", "remote"))
    out = pair.send(ps, s)
    for p, c in zip(ps, out):
        assert c.cached_tokens >= 0.95 * (len(p) // BS * BS), (len(p), c.cached_tokens)
        assert c.cached_tokens == len(p) - 1
    assert_as_vllm_alone(out, alone(baseline, ps))
    assert pair.decode.counter("kvstrata_hit_tokens_total") - hit == sum(len(p) - 1 for p in ps)
    def poke() -> None:  # a prompt the decode server's own prefix cache holds: it saves nothing
        pair.send([ps[0]], s, url=pair.decode.url, max_tokens=1)

    grown = settled(lambda: pair.decode.counter("kvstrata_saved_blocks_total"), poke) - saved
    assert grown == sum(own_blocks(len(p)) for p in ps) > 0
    # its disk tier got its own blocks alone, as the shared tier did (no copy of what it loaded)
    on_disk = settled(lambda: pair.decode.counter("kvstrata_bytes_written_total", "l2"), poke) - l2
    assert on_disk == settled(lambda: pair.decode.counter("kvstrata_bytes_written_total", "remote"), poke) - remote > 0
    assert settled(lambda: pair.prefill.gauge("vllm:kv_cache_usage_perc")) == 0  # delayed frees done
    assert pair.router_stats()["prefill_failures"] == 0


def test_decode_never_computes_a_prompt_block_the_prefill_published(pairs, baseline):
    """Scenario: 8 conversations of 2 turns at concurrency 8; each first turn ends 2 tokens short
    of a block, so the decode server completes that block with its output. The decode server's
    saved blocks (kvstrata's counter) are exactly those: it never computes a block the prefill
    server published. The second turns extend the first ones: the prefill server loads the block
    the decode server computed from the shared tier, and the decode server again loads all but
    the last prompt token."""
    pair = pairs("redis")
    s, rng = salt(), random.Random(31)
    first = [[rng.randrange(10, 3000) for _ in range(BS * rng.randrange(6, 14) + BS - 2)] for _ in range(8)]
    saved = pair.decode.counter("kvstrata_saved_blocks_total")
    out1 = pair.send(first, s)
    second = [p + c.tokens + [rng.randrange(10, 3000) for _ in range(40)] for p, c in zip(first, out1)]
    prefill_remote = pair.prefill.counter("kvstrata_hit_tokens_total", "remote")
    out2 = pair.send(second, s)
    for p, c in zip(first + second, out1 + out2):
        assert c.cached_tokens == len(p) - 1
    assert_as_vllm_alone(out1 + out2, alone(baseline, first + second))
    grown = settled(lambda: pair.decode.counter("kvstrata_saved_blocks_total")) - saved
    assert grown == sum(own_blocks(len(p)) for p in first + second) >= len(first)
    # each second turn's prefill loaded the block the decode server completed in its first turn
    assert pair.prefill.counter("kvstrata_hit_tokens_total", "remote") - prefill_remote >= len(first) * BS


def test_reset_on_the_prefill_server_hides_older_blocks_from_the_decode_server(pairs, baseline):
    """Scenario: a prompt is published; both servers reset their prefix cache and kvstrata's, as
    after a weight update (``reset_prefix_cache(reset_connector=True)``: the prefill server's
    makes a new epoch in Redis, the decode server's joins it; a server that did not reset would
    serve and save nothing: kvstrata.epochs.joins). The decode server then loads nothing of the prompt
    (its blocks are of the older epoch): it computes it, answers as vLLM alone and stores what it
    computed, under the new epoch, where the next request through the router finds it."""
    pair = pairs("redis")
    p, s = clear_prompts(baseline, 32, 1, 500, 501)[0], salt()
    assert pair.send([p], s)[0].cached_tokens == len(p) - 1
    for server, query in ((pair.prefill, "?reset_external=true"), (pair.decode, "?reset_external=true")):
        deadline = time.monotonic() + 30
        while not json.loads(server.post("/reset_prefix_cache" + query))["success"]:
            assert time.monotonic() < deadline, "reset refused for 30 s"
            time.sleep(0.5)
    time.sleep(1.0)  # past remote.invalidation_ms + remote.confirm_margin_ms (250 ms)
    hit, saved = pair.decode.counter("kvstrata_hit_tokens_total"), pair.decode.counter("kvstrata_saved_blocks_total")
    direct = pair.send([p], s, url=pair.decode.url)[0]
    assert not direct.cached_tokens
    assert_as_vllm_alone([direct], alone(baseline, [p]))
    assert pair.decode.counter("kvstrata_hit_tokens_total") == hit
    assert settled(lambda: pair.decode.counter("kvstrata_saved_blocks_total")) - saved == len(p) // BS + 1
    assert json.loads(pair.decode.post("/reset_prefix_cache"))["success"]
    again = pair.send([p], s)[0]
    assert again.cached_tokens == len(p) - 1 and again.tokens == direct.tokens


def test_prefill_killed_between_the_legs_decode_answers_correctly(pairs, baseline):
    """Scenario: a prompt's prefill leg is answered, then the prefill server is killed (SIGKILL)
    before the decode leg: its blocks were published before the answer, so the decode server
    loads them and answers as vLLM alone. A prompt sent through the router after that loses its
    prefill leg (counted by the router): the decode server computes it whole and answers as vLLM
    alone. Last of the Redis pair's tests (its prefill server is gone)."""
    pair = pairs("redis")
    a, b = clear_prompts(baseline, 33, 2, 400, 600)
    s = salt()
    pair.send([a], s, url=pair.prefill.url, max_tokens=1)  # the prefill leg alone
    pair.prefill.kill()
    loaded = pair.send([a], s, url=pair.decode.url)[0]  # the decode leg
    assert loaded.cached_tokens == len(a) - 1
    failures = pair.router_stats()["prefill_failures"]
    recomputed = pair.send([b], s)[0]
    assert pair.router_stats()["prefill_failures"] == failures + 1
    assert not recomputed.cached_tokens
    assert_as_vllm_alone([loaded, recomputed], alone(baseline, [a, b]))


def test_shared_folder_pair_loads_what_the_prefill_published(pairs, baseline):
    """Scenario: the first test's checks, fewer requests, on the shared-folder backend: every
    prompt but its last token loaded from the folder, vLLM-alone outputs, and the decode server
    stores only the blocks it completes itself."""
    pair = pairs("fs")
    ps, s = prompts(34, 8), salt()
    saved = pair.decode.counter("kvstrata_saved_blocks_total")
    out = pair.send(ps, s)
    assert [c.cached_tokens for c in out] == [len(p) - 1 for p in ps]
    assert_as_vllm_alone(out, alone(baseline, ps))
    assert settled(lambda: pair.decode.counter("kvstrata_saved_blocks_total")) - saved == sum(
        own_blocks(len(p)) for p in ps)
    assert settled(lambda: pair.prefill.gauge("vllm:kv_cache_usage_perc")) == 0
