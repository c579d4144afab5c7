"""The async HTTP client of the tools: aiohttp sessions for loopback servers, ``astream`` (the one
reader of streamed answers, vLLM's ``/v1/completions`` and SGLang's ``/generate`` alike) and
``acomplete`` (one greedy completion of token ids, timed). A caller runs any number of requests at
once on one event loop, never a thread each. aiohttp is imported when a session is made.
``serving`` has the synchronous forms.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any, AsyncIterator, NamedTuple

if TYPE_CHECKING:
    import aiohttp

READ_BUFFER = 1 << 22  # the longest line a streamed answer may have (SGLang repeats every id so far)


class HTTPStatusError(OSError):
    """A server answered with a status other than 2xx (an ``OSError``, as a refused connection is:
    callers that count failed requests catch both)."""

    def __init__(self, url: str, status: int, body: str) -> None:
        super().__init__(f"HTTP {status} from {url}: {body[:500]}")
        self.status = status


def session(timeout: float = 600, limit: int = 0) -> "aiohttp.ClientSession":
    """An aiohttp session for loopback servers: ``limit`` connections at once (0: no limit),
    ``timeout`` seconds per request in all. Open it inside the event loop that uses it."""
    import aiohttp

    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout),
                                 connector=aiohttp.TCPConnector(limit=limit), read_bufsize=READ_BUFFER)


async def arequest(http: "aiohttp.ClientSession", method: str, url: str, body: dict[str, Any] | None = None) -> bytes:
    """One request; the answer's body, or ``HTTPStatusError``."""
    data = None if body is None else json.dumps(body).encode()
    async with http.request(method, url, data=data, headers={"Content-Type": "application/json"}) as r:
        payload = await r.read()
        if r.status >= 300:
            raise HTTPStatusError(url, r.status, payload.decode(errors="replace"))
        return payload


class Completion(NamedTuple):
    ttft_ms: float
    total_ms: float
    tokens: list[int]
    cached_tokens: int | None


async def astream(http: "aiohttp.ClientSession", url: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    """POST ``body`` as JSON to ``url`` and yield each chunk of the server-sent event stream, parsed.

    The request goes out on the first ``__anext__``, so a caller's clock started before the loop
    times the whole request. ``data: [DONE]`` and non-data lines are skipped; the stream ends when
    the server closes it. vLLM's ``/v1/completions`` and SGLang's ``/generate`` both stream this way.
    """
    async with http.post(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}) as r:
        if r.status >= 300:
            raise HTTPStatusError(url, r.status, (await r.read()).decode(errors="replace"))
        async for raw in r.content:  # one line at a time
            line = raw.decode().strip()
            if line.startswith("data:") and line != "data: [DONE]":
                yield json.loads(line[5:])


def completion_body(model: str, prompt: list[int], max_tokens: int, cache_salt: str | None = None,
                    **extra: Any) -> dict[str, Any]:
    """A greedy streamed ``/v1/completions`` request of token ids that returns its token ids."""
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                            "stream": True, "return_token_ids": True,
                            "stream_options": {"include_usage": True}, **extra}
    if cache_salt:
        body["cache_salt"] = cache_salt
    return body


async def acomplete(http: "aiohttp.ClientSession", url: str, model: str, prompt: list[int], max_tokens: int = 16,
                    cache_salt: str | None = None, **extra: Any) -> Completion:
    """Greedy streamed completion of token ids from the server at ``url``; TTFT is the time to the
    first streamed token."""
    start = time.perf_counter()
    ttft = None
    tokens: list[int] = []
    cached = None
    async for chunk in astream(http, url + "/v1/completions", completion_body(model, prompt, max_tokens,
                                                                              cache_salt, **extra)):
        for choice in chunk.get("choices", []):
            if ttft is None and (choice.get("text") or choice.get("token_ids")):
                ttft = (time.perf_counter() - start) * 1000
            tokens += choice.get("token_ids") or []
        usage = chunk.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens", cached)
    total = (time.perf_counter() - start) * 1000
    return Completion(ttft if ttft is not None else total, total, tokens, cached)
