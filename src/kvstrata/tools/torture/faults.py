"""tools/torture/faults.py: ``FaultyProxy``, a loopback TCP proxy that makes a service slow, hung or gone
on demand, for ``kvstrata torture --net-faults`` and the tests of a faulty shared tier.

Modes (``MODES``), switched at any time from any thread (``set_mode``) or cycled at random
(``start_cycling``):

- ``pass``: bytes are forwarded as they come.
- ``slow``: every chunk is forwarded ``delay_s`` late, in order (replies come after kvstrata's
  ``remote.timeout_ms``: each call times out, yet the service has done it).
- ``hang``: connections are accepted and nothing is forwarded in either direction (what was sent
  is delivered, in order, once the mode changes; a client that gave up has closed by then).
- ``refuse``: the listening port is closed (connections are refused) and every open connection is
  reset.

The seconds spent in each mode are counted (``seconds_in``). One asyncio loop on a daemon thread
serves every connection.
"""

from __future__ import annotations

import asyncio
import logging
import random
import socket
import threading
import time
from collections import deque
from urllib.parse import urlsplit, urlunsplit

log = logging.getLogger(__name__)

MODES = ("pass", "slow", "hang", "refuse")
_CHUNK = 1 << 16


class FaultyProxy:
    """``127.0.0.1:port`` forwards to ``host:port`` of ``target_url`` (``url`` is the target's URL
    with the proxy's address), misbehaving as its mode says."""

    def __init__(self, target_url: str, delay_s: float = 0.3) -> None:
        parts = urlsplit(target_url)
        if not parts.hostname or not parts.port:
            raise ValueError(f"FaultyProxy: {target_url!r} names no host and port")
        self._target = (parts.hostname, parts.port)
        self.delay_s = delay_s
        self._mode = "pass"
        self._since = time.monotonic()
        self._seconds = dict.fromkeys(MODES, 0.0)
        self._lock = threading.Lock()
        self._conns: set[asyncio.Transport] = set()
        self._server: asyncio.AbstractServer | None = None
        self._stop = threading.Event()
        self._cycler: threading.Thread | None = None
        with socket.socket() as s:  # a port of our own, bound again whenever the mode is not refuse
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        netloc = f"{parts.username or ''}{':' + parts.password if parts.password else ''}"
        netloc = f"{netloc}@127.0.0.1:{self.port}" if netloc else f"127.0.0.1:{self.port}"
        self.url = urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvstrata-faults", daemon=True)
        self._thread.start()
        self._call(self._listen())

    # ------------------------------------------------------------------ control
    @property
    def mode(self) -> str:
        return self._mode

    def set_mode(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"FaultyProxy: mode {mode!r} is not one of {', '.join(MODES)}")
        with self._lock:
            now = time.monotonic()
            self._seconds[self._mode] += now - self._since
            self._since = now
            previous, self._mode = self._mode, mode
        if mode == "refuse" and previous != "refuse":
            self._call(self._refuse())
        elif previous == "refuse" and mode != "refuse":
            self._call(self._listen())
        log.debug("fault proxy: %s -> %s", previous, mode)

    def seconds_in(self) -> dict[str, float]:
        """Seconds spent in each mode so far."""
        with self._lock:
            out = dict(self._seconds)
            out[self._mode] += time.monotonic() - self._since
        return {mode: round(s, 2) for mode, s in out.items()}

    def start_cycling(self, seed: int = 0, low_s: float = 1.0, high_s: float = 3.0) -> None:
        """Cycle pass -> slow -> pass -> hang -> pass -> refuse -> ..., each for a random
        ``low_s``-``high_s`` seconds, on a thread, until ``close``."""
        rng = random.Random(f"netfault-{seed}")

        def cycle() -> None:
            order = ("slow", "pass", "hang", "pass", "refuse", "pass")
            i = 0
            while not self._stop.wait(rng.uniform(low_s, high_s)):
                self.set_mode(order[i % len(order)])
                i += 1

        self._cycler = threading.Thread(target=cycle, name="kvstrata-faults-cycle", daemon=True)
        self._cycler.start()

    def close(self) -> None:
        self._stop.set()
        if self._cycler is not None:
            self._cycler.join(timeout=5)
        self.set_mode("pass")  # count the last spell
        self._call(self._refuse())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    def __enter__(self) -> "FaultyProxy":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ the loop's side
    def _call(self, coro: object) -> None:
        asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=10)  # type: ignore[arg-type]

    async def _listen(self) -> None:
        if self._server is None:
            self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port, reuse_address=True)

    async def _refuse(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for transport in list(self._conns):
            transport.abort()  # a reset, as from a restarted server
        self._conns.clear()

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection(*self._target)
        except OSError:
            client_w.transport.abort()
            return
        pair = (client_w.transport, server_w.transport)
        self._conns.update(pair)  # type: ignore[arg-type]
        try:
            await asyncio.gather(self._pump(client_r, server_w), self._pump(server_r, client_w))
        finally:
            for transport in pair:
                self._conns.discard(transport)  # type: ignore[arg-type]
                transport.abort()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Forward one direction: a reader task queues chunks with their arrival time, and this
        task writes each when the mode lets it (slow: ``delay_s`` after it arrived)."""
        queue: deque[tuple[float, bytes]] = deque()
        arrived = asyncio.Event()
        done = False

        async def read() -> None:
            nonlocal done
            try:
                while data := await reader.read(_CHUNK):
                    queue.append((time.monotonic(), data))
                    arrived.set()
            except (ConnectionError, OSError):
                pass
            done = True
            arrived.set()

        reading = asyncio.ensure_future(read())
        try:
            while True:
                if not queue:
                    if done:
                        break
                    arrived.clear()
                    await arrived.wait()
                    continue
                if self._mode == "hang":
                    await asyncio.sleep(0.02)
                    continue
                at, data = queue[0]
                if self._mode == "slow" and time.monotonic() < at + self.delay_s:
                    await asyncio.sleep(min(0.02, at + self.delay_s - time.monotonic()))
                    continue
                queue.popleft()
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            reading.cancel()
            writer.close()  # this direction ended: pass the close on, so the other one ends too
