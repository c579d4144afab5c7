"""The prefill/decode router (``kvstrata.tools.pd_router``) and the P/D config keys, with no engine:
the router between two small aiohttp servers that record what they are sent (the real run through
vLLM servers: tests/engines/test_vllm_disagg.py)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from kvstrata.config import ConfigError, load_config
from kvstrata.tools.client import astream, session
from kvstrata.tools.pd_router import Router, prefill_body
from kvstrata.tools.serving import free_port

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def test_example_yaml_files_are_valid_and_configure_the_roles():
    prefill = load_config(ROOT / "examples" / "disagg" / "prefill.yaml")
    decode = load_config(ROOT / "examples" / "disagg" / "decode.yaml")
    assert prefill.remote.enabled and decode.remote.enabled and prefill.remote.url == decode.remote.url
    assert decode.saves.consumer == "computed" and prefill.saves.publish_wait_ms > 0


def test_a_bad_consumer_policy_names_file_key_and_value(tmp_path):
    bad = tmp_path / "decode.yaml"
    bad.write_text("saves:\n  consumer: everything\n")
    with pytest.raises(ConfigError) as e:
        load_config(bad)
    assert str(bad) in str(e.value) and "saves.consumer" in str(e.value) and "everything" in str(e.value)


def test_prefill_leg_asks_one_token_unstreamed_with_the_same_prompt_and_salt():
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 64, "stream": True, "cache_salt": "s",
            "stream_options": {"include_usage": True}, "min_tokens": 4, "temperature": 0}
    assert prefill_body(body) == {"model": "m", "prompt": [1, 2, 3], "max_tokens": 1, "cache_salt": "s",
                                  "temperature": 0}
    assert prefill_body({"messages": [], "max_completion_tokens": 9})["max_completion_tokens"] == 1
    assert body["max_tokens"] == 64  # the decode leg's body is untouched


class Upstream:
    """A stand-in instance: records each request body, answers a stream of ``chunks`` chunks."""

    def __init__(self, chunks: int = 3) -> None:
        self.bodies: list[dict] = []
        self.chunks = chunks
        self.port = free_port()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": "x"}]})
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for i in range(self.chunks):
            await out.write(f"data: {json.dumps({'choices': [{'token_ids': [i]}]})}\n\n".encode())
            await asyncio.sleep(0.01)
        await out.write(b"data: [DONE]\n\n")
        return out

    async def start(self) -> web.AppRunner:
        app = web.Application()
        app.router.add_post("/v1/completions", self.handle)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        return runner


async def _through_router(prefill_up: bool) -> tuple[Upstream, Upstream, list[dict], dict]:
    prefill, decode = Upstream(), Upstream(chunks=4)
    runners = [await decode.start()] + ([await prefill.start()] if prefill_up else [])
    router = Router([f"http://127.0.0.1:{prefill.port}"], [f"http://127.0.0.1:{decode.port}"], timeout=10)
    port = free_port()
    runner = web.AppRunner(router.app())
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        body = {"model": "m", "prompt": [5, 6], "max_tokens": 8, "stream": True, "cache_salt": "t"}
        async with session(10) as http:
            chunks = [c async for c in astream(http, f"http://127.0.0.1:{port}/v1/completions", body)]
            async with http.get(f"http://127.0.0.1:{port}/router/stats") as r:
                stats = await r.json()
    finally:
        for r in [runner, *runners]:
            await r.cleanup()
    return prefill, decode, chunks, stats


def test_router_prefills_one_token_then_streams_the_decode_answer():
    prefill, decode, chunks, stats = asyncio.run(_through_router(prefill_up=True))
    assert [b["max_tokens"] for b in prefill.bodies] == [1] and "stream" not in prefill.bodies[0]
    assert prefill.bodies[0]["prompt"] == [5, 6] and prefill.bodies[0]["cache_salt"] == "t"
    assert decode.bodies == [{"model": "m", "prompt": [5, 6], "max_tokens": 8, "stream": True, "cache_salt": "t"}]
    assert [c["choices"][0]["token_ids"] for c in chunks] == [[0], [1], [2], [3]]
    assert stats["requests"] == 1 and stats["prefill_failures"] == 0


def test_a_prefill_instance_that_is_down_leaves_the_prompt_to_the_decode_instance():
    prefill, decode, chunks, stats = asyncio.run(_through_router(prefill_up=False))
    assert not prefill.bodies and len(decode.bodies) == 1 and len(chunks) == 4
    assert stats == {"requests": 1, "prefill_failures": 1, "prefill_seconds": 0.0}
