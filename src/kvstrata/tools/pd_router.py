"""A prefill/decode router for vLLM instances that share a kvstrata store (disaggregated serving).

Each ``/v1/completions`` or ``/v1/chat/completions`` request goes first to a prefill instance
(``kv_role: kv_producer``) with ``max_tokens: 1`` and no streaming; that answer comes once the
prompt's blocks are published to the shared tier (``kvstrata/adapters/vllm/roles.py``). The
request then goes, unchanged, to a decode instance (``kv_consumer``), which loads the prompt's
blocks instead of computing them, and its answer is streamed back as it comes. A prefill leg that
fails (an instance down, a timeout) is logged and counted, never fatal: the decode instance then
computes what it does not find. Instances are taken in turn (round-robin).

Run it with ``python -m kvstrata.tools.pd_router --prefill URL --decode URL [--port 8000]``;
``examples/disagg/run.sh`` starts it beside a prefill and a decode vLLM server on one Redis.
``GET /router/stats`` gives the legs' counts (``Stats``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aiohttp import ClientSession, web

log = logging.getLogger(__name__)

ROUTES = ("/v1/completions", "/v1/chat/completions")
PASSED_HEADERS = ("Authorization",)  # what a client's request keeps on its way to the instances


@dataclass
class Stats:
    requests: int = 0
    prefill_failures: int = 0  # prefill legs that failed: the decode instance computed the prompt
    prefill_seconds: float = 0.0  # summed over the prefill legs that answered


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg of a request: the same prompt, salt and sampling, one token, not streamed."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "min_tokens")}
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:  # the chat API's newer name
        out["max_completion_tokens"] = 1
    return out


class Router:
    """The router's state: its instances, one HTTP session, the counts."""

    def __init__(self, prefill: list[str], decode: list[str], timeout: float = 600) -> None:
        if not prefill or not decode:
            raise ValueError("a router needs at least one prefill and one decode instance")
        self.prefill_urls, self.decode_urls = [u.rstrip("/") for u in prefill], [u.rstrip("/") for u in decode]
        self._prefill, self._decode = itertools.cycle(self.prefill_urls), itertools.cycle(self.decode_urls)
        self.timeout = timeout
        self.stats = Stats()
        self._http: ClientSession | None = None

    async def start(self, app: "web.Application") -> None:
        from kvstrata.tools.client import session

        self._http = session(self.timeout)

    async def close(self, app: "web.Application") -> None:
        if self._http is not None:
            await self._http.close()

    @property
    def http(self) -> "ClientSession":
        assert self._http is not None, "the router's session opens with its application"
        return self._http

    async def _prefill_leg(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> None:
        url = next(self._prefill) + path
        started = time.perf_counter()
        try:
            async with self.http.post(url, json=prefill_body(body), headers=headers) as r:
                await r.read()
                if r.status >= 300:
                    raise RuntimeError(f"HTTP {r.status}")
            self.stats.prefill_seconds += time.perf_counter() - started
        except Exception as e:  # an I/O edge: the decode instance computes the prompt instead
            self.stats.prefill_failures += 1
            log.warning("prefill leg at %s failed (%s: %s); the decode instance computes the prompt",
                        url, type(e).__name__, e)

    async def handle(self, request: "web.Request") -> "web.StreamResponse":
        from aiohttp import web

        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            return web.json_response({"error": "the body is not JSON"}, status=400)
        if not isinstance(body, dict):
            return web.json_response({"error": "the body is not a JSON object"}, status=400)
        self.stats.requests += 1
        headers = {h: request.headers[h] for h in PASSED_HEADERS if h in request.headers}
        await self._prefill_leg(request.path, body, headers)
        async with self.http.post(next(self._decode) + request.path, json=body, headers=headers) as r:
            if not body.get("stream") or r.status >= 300:
                return web.Response(body=await r.read(), status=r.status, content_type=r.content_type)
            out = web.StreamResponse(status=r.status, headers={"Content-Type": r.headers.get(
                "Content-Type", "text/event-stream"), "Cache-Control": "no-cache"})
            await out.prepare(request)
            async for chunk in r.content.iter_any():  # as the decode instance sends it
                await out.write(chunk)
            await out.write_eof()
            return out

    async def health(self, request: "web.Request") -> "web.Response":
        from aiohttp import web

        return web.Response(text="ok")

    async def models(self, request: "web.Request") -> "web.Response":
        from aiohttp import web

        async with self.http.get(self.decode_urls[0] + "/v1/models") as r:
            return web.Response(body=await r.read(), status=r.status, content_type=r.content_type)

    async def stats_view(self, request: "web.Request") -> "web.Response":
        from aiohttp import web

        return web.json_response(asdict(self.stats))

    def app(self) -> "web.Application":
        from aiohttp import web

        app = web.Application(client_max_size=64 << 20)  # a prompt of token ids is a large body
        for path in ROUTES:
            app.router.add_post(path, self.handle)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/router/stats", self.stats_view)
        app.on_startup.append(self.start)
        app.on_cleanup.append(self.close)
        return app


def main(argv: list[str] | None = None) -> None:
    from aiohttp import web

    p = argparse.ArgumentParser(prog="python -m kvstrata.tools.pd_router", description=__doc__.split("\n\n")[0])
    p.add_argument("--prefill", action="append", required=True, help="a prefill instance's URL (repeatable)")
    p.add_argument("--decode", action="append", required=True, help="a decode instance's URL (repeatable)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--timeout", type=float, default=600, help="seconds per leg")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    router = Router(args.prefill, args.decode, args.timeout)
    log.info("P/D router on %s:%d: prefill %s, decode %s", args.host, args.port, json.dumps(router.prefill_urls),
             json.dumps(router.decode_urls))
    web.run_app(router.app(), host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
