"""A Redis for the benchmarks: the one given by URL (flushed first), else a private ``redis-server``.

The private server listens on a free loopback port, keeps nothing on disk (no RDB, no AOF), runs
in its own session and is killed on exit. ``python -m benchmarks serve``, ``ttft`` and ``remote`` use it.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator

from kvstrata.tools.serving import free_port, listening

MAXMEMORY = "4gb"


@contextlib.contextmanager
def redis_server(url: str | None = None, folder: Path | None = None, maxmemory: str | None = MAXMEMORY,
                 flush: bool = True, start_timeout: float = 30) -> Iterator[str]:
    """Yield a Redis URL: ``url`` (after FLUSHDB if ``flush``), else a private server's (its log in
    ``folder``)."""
    if url:
        if flush:
            import redis

            redis.Redis.from_url(url).flushdb()
        yield url
        return
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("needs a Redis URL or redis-server on PATH")
    folder = Path(folder) if folder else Path(tempfile.mkdtemp(prefix="kvstrata-redis-"))
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    cmd = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
           "--dir", str(folder)]
    if maxmemory:
        cmd += ["--maxmemory", maxmemory, "--maxmemory-policy", "volatile-lru"]  # docs/shared-tier.md's
    with open(folder / "redis.log", "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + start_timeout
        while not listening(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start (see {folder / 'redis.log'})")
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.kill()
        proc.wait()
