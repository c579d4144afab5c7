"""SGLang 0.5.23's prefill/decode split on CPU, through kvstrata's store.

What SGLang 0.5.23 does (``sglang/srt/disaggregation/``, ``arg_groups/pd_disaggregation_hook.py``):

- A prefill (``--disaggregation-mode prefill``) and a decode server (``decode``) always move the
  prompt's KV over a transfer engine: ``mooncake`` (the default), ``mooncake_tcp`` (Mooncake with
  ``MC_FORCE_TCP=1``: no RDMA), ``nixl``, ``mori``, ``ascend``, or ``fake``. ``fake`` moves no KV
  (synthetic decode benchmarks): a prefill server refuses it, and so does a decode server with
  its radix cache on. SGLang ships none of the engines: without Mooncake the prefill server's
  scheduler dies at start, "ImportError: Please install mooncake by following the instructions
  at https://kvcache-ai.github.io/Mooncake/getting_started/build.html to run SGLang with
  MooncakeTransferEngine."
- A decode server with ``--disaggregation-decode-enable-radix-cache`` and HiCache with a storage
  backend asks that storage for the prompt's prefix before it asks the prefill server for KV
  (``decode_hicache_mixin._build_decode_prefix_match``: L1 device + L2 host + L3 storage), tells
  the prefill server that prefix length, and loads the prefix from storage while the prefill
  server sends only the rest. With kvstrata as the storage backend of both servers (one store,
  the same keys and namespace), a prefix the prefill server wrote is loaded by the decode server.

On this CPU machine that runs with the PyPI wheel ``mooncake-transfer-engine-non-cuda`` (0.3.13.post1;
it needs Debian's ``libibverbs1`` to load, even over TCP), ``--disaggregation-transfer-backend
mooncake_tcp`` on loopback (``SGLANG_HOST_IP=127.0.0.1``), and one more test-only patch in the
CPU shims (``sglang_cpu_patches.patch_mooncake_sender``): SGLang's Mooncake sender declares ``supports_host_tensor_indices``, which makes the
prefill server stage page indices in pinned memory behind a CUDA event, and on CPU the first
prompt's send fails with "RuntimeError: pin_memory=True requires a CUDA or other accelerator
backend; no pinned memory allocator is available on this system." (the prefill scheduler dies,
the decode server answers 500, "Lost connection with prefill instance"). The patch turns
that flag off, so the sender takes its plain ``kv_to_page_indices`` path. scripts/setup_sglang.sh
installs the wheel and scripts/setup.sh the library; without them the server test is skipped,
saying so.

Servers: two (one prefill, one decode, up together); the session's SGLang server is stopped first.
"""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from engines.launchers import (PAGE, SGLangServers, sglang_probe, ids, needs_sglang, new_sglang_server, sglang_args,
                              sglang_config, sglang_log, sglang_python, tiny_model)
from kvstrata.tools.serving import free_port
from tests.harness.sglang_server import SGLangServer

pytestmark = [needs_sglang, pytest.mark.timeout(900)]

PROMPT = ids(30, 600)  # 37 full pages of 16 and an 8-token tail

MOONCAKE_WHEEL = "mooncake-transfer-engine-non-cuda"

# In the SGLang environment (no server): SGLang's own argument resolution of the test server's
# flags in each P/D mode, and what stands between its Mooncake path and a CPU.
IN_PROCESS = """  # after SGLANG_PROBE (tests/engines/launchers.py)
def resolve(*extra):
    return lambda: prepare_server_args(argv + list(extra)).resolve_once()
def engine():
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import MooncakeTransferEngine
    MooncakeTransferEngine("127.0.0.1")
def sender_flag():
    import inspect
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVSender
    assert "supports_host_tensor_indices = True" in inspect.getsource(MooncakeKVSender), "upstream changed"
    assert MooncakeKVSender.supports_host_tensor_indices is False, "the shims' patch_mooncake_sender did not apply"
print("RESULT " + json.dumps({
    "prefill_fake": outcome(resolve("--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", "fake")),
    "decode_fake": outcome(resolve("--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "fake")),
    "decode_fake_radix": outcome(resolve("--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "fake",
                                         "--disaggregation-decode-enable-radix-cache")),
    "prefill_mooncake_tcp": outcome(resolve("--disaggregation-mode", "prefill",
                                            "--disaggregation-transfer-backend", "mooncake_tcp")),
    "decode_mooncake_tcp_radix": outcome(resolve("--disaggregation-mode", "decode",
                                                 "--disaggregation-transfer-backend", "mooncake_tcp",
                                                 "--disaggregation-decode-enable-radix-cache")),
    "pinned_cpu": outcome(lambda: torch.empty(4, dtype=torch.int64, device="cpu", pin_memory=True)),
    "sender_flag": outcome(sender_flag),
    "engine": outcome(engine),
}))
"""


def in_process_checks(config: Path) -> dict[str, str]:
    argv = sglang_args(tiny_model(), config)
    return sglang_probe(IN_PROCESS, argv, MC_FORCE_TCP="1")


def mooncake_missing() -> str | None:
    """Why SGLang's interpreter cannot load Mooncake's transfer engine, or None when it can."""
    out = subprocess.run([sglang_python(), "-c", "from mooncake.engine import TransferEngine"],
                         capture_output=True, text=True, timeout=120)
    if out.returncode == 0:
        return None
    return (out.stderr.strip().splitlines() or ["?"])[-1]


def test_sglang_pd_modes_need_a_real_transfer_engine_and_its_fake_one_is_refused(tmp_path):
    """Argument checks only (one SGLang import, no server): the ``fake`` transfer backend is
    refused for a prefill server and for a decode server with its radix cache (the one that asks
    storage for a prefix); a decode server with HiCache and without its radix cache is refused
    whatever the backend; ``mooncake_tcp`` passes both roles' checks. The Mooncake sender's pinned-index path is CUDA-only on this torch. The engine
    itself loads or not depending on the Mooncake wheel (recorded either way)."""
    checks = in_process_checks(sglang_config(tmp_path / "sglang.json", tmp_path / "l2"))
    assert checks["prefill_fake"] == "AssertionError: Prefill server does not support 'fake' as the transfer backend"
    # A decode server keeps no radix cache unless asked, and HiCache needs one.
    assert checks["decode_fake"] == (
        "ValueError: The arguments enable-hierarchical-cache and disable-radix-cache are mutually exclusive "
        "and cannot be used at the same time. Please use only one of them.")
    assert checks["decode_fake_radix"] == (
        "ValueError: --disaggregation-decode-enable-radix-cache is incompatible with "
        "--disaggregation-transfer-backend fake")
    assert checks["prefill_mooncake_tcp"] == "ok" and checks["decode_mooncake_tcp_radix"] == "ok", checks
    assert checks["pinned_cpu"].startswith(
        "RuntimeError: pin_memory=True requires a CUDA or other accelerator backend"), checks["pinned_cpu"]
    assert checks["sender_flag"] == "ok", checks["sender_flag"]  # True upstream, turned off by the shims
    assert checks["engine"] == "ok" or checks["engine"].startswith(
        "ImportError: Please install mooncake by following the instructions"), checks["engine"]


# ------------------------------------------------------------------------------ the real split
def metric(server: SGLangServer, name: str) -> float:
    """The sum of a kvstrata series over its labels (tiers) in the server's /metrics."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(v) for v in re.findall(rf"^{name}(?:\{{[^}}]*\}})? (\S+)$", text, re.M))


def pd_generate(prefill: SGLangServer, decode: SGLangServer, bootstrap_port: int, prompt: list[int],
                max_new_tokens: int = 8) -> dict[str, Any]:
    """Both legs of one request, as SGLang's router sends them: the same body (bootstrap host,
    port and room) to the prefill and the decode server at once; the decode server's answer."""
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap_port,
            "bootstrap_room": int.from_bytes(os.urandom(7), "little")}
    first: dict[str, Any] = {}

    def prefill_leg() -> None:
        try:
            first["out"] = prefill.post("/generate", body)
        except Exception as e:  # reported below, with the decode leg's outcome
            first["error"] = e

    leg = threading.Thread(target=prefill_leg)
    leg.start()
    try:
        out = decode.post("/generate", body)
    finally:
        leg.join(decode.request_timeout)
    assert "error" not in first, f"prefill leg: {first['error']}\n{prefill.tail()}"
    assert out["output_ids"][:1] == first["out"]["output_ids"], (out, first["out"])  # the prefill's token leads
    return out


def wait_metric(server: SGLangServer, name: str, at_least: float, timeout: float = 60) -> float:
    """SGLang feeds kvstrata's series from its scheduler loop: wait for the figure."""
    deadline = time.monotonic() + timeout
    while (value := metric(server, name)) < at_least and time.monotonic() < deadline:
        time.sleep(0.5)
    return value


def pd_server(config: Path, log: Path, mode: str, bootstrap_port: int,
              extra: list[str], metrics: bool = False) -> SGLangServer:
    server = new_sglang_server(tiny_model(), config, log, metrics=metrics)
    server.cmd += ["--disaggregation-mode", mode, "--disaggregation-transfer-backend", "mooncake_tcp",
                   "--disaggregation-bootstrap-port", str(bootstrap_port), *extra]
    server.env["SGLANG_HOST_IP"] = "127.0.0.1"  # Mooncake's TCP transport and bootstrap: loopback only
    return server


def test_sglang_decode_server_loads_from_strata_storage_the_prefix_the_prefill_server_wrote(
        sglang_servers: SGLangServers, tmp_path: Path):
    """Scenario: one prefill and one decode server (``mooncake_tcp``), kvstrata the HiCache
    storage backend of both, on one disk tier. The decode server runs its radix cache with HiCache
    on ``write_back`` (it writes nothing to storage while its device cache holds the prompt), so
    every page in the store is the prefill server's.

    A prompt's first P/D request: the decode server finds nothing in storage (it asks before the
    prefill server computes) and receives every page from the prefill server, which stores them.
    The decode server's caches are flushed; the same prompt again: the decode server loads the
    prompt's 37 full pages from kvstrata (its counters), the prefill server sends the tail, and
    the output equals the first one."""
    missing = mooncake_missing()
    if missing is not None:
        pytest.skip(f"no Mooncake transfer engine in SGLang's environment ({missing}): "
                    f"pip install {MOONCAKE_WHEEL} there, and apt-get install libibverbs1")
    sglang_servers.stop()  # two servers of this test's on 2 cores
    l2 = tmp_path / "l2"
    config = sglang_config(tmp_path / "sglang.json", l2)
    port = free_port()
    prefill = pd_server(config, tmp_path / "prefill.log", "prefill", port, [])
    decode = pd_server(config, tmp_path / "decode.log", "decode", free_port(),
                       ["--disaggregation-decode-enable-radix-cache", "--hicache-write-policy", "write_back"],
                       metrics=True)
    pages = len(PROMPT) // PAGE
    try:
        with ThreadPoolExecutor(2) as pool:
            for started in [pool.submit(s.__enter__) for s in (prefill, decode)]:
                started.result()
        first = pd_generate(prefill, decode, port, PROMPT)
        deadline = time.monotonic() + 60  # the prefill server's backups are asynchronous
        while len(files := list((l2 / "blocks").glob("*/*.kvb"))) < pages:
            assert time.monotonic() < deadline, f"{len(files)} of {pages} pages reached kvstrata's disk tier"
            time.sleep(0.2)
        assert metric(decode, "kvstrata_saved_blocks_total") == 0  # every page there is the prefill's
        assert metric(decode, "kvstrata_hit_tokens_total") == 0
        decode.flush()
        again = pd_generate(prefill, decode, port, PROMPT)
        loaded = wait_metric(decode, "kvstrata_hit_tokens_total", pages * PAGE)
    finally:
        prefill.stop()
        decode.stop()
    assert loaded == pages * PAGE, (loaded, sglang_log(decode)[-4000:])
    assert len(first["output_ids"]) == 8 and again["output_ids"] == first["output_ids"], (first, again)
    # One store, one key space: both servers name the same kvstrata namespace.
    spaces = [re.findall(r"kvstrata: namespace (\w+) ", sglang_log(s)) for s in (prefill, decode)]
    assert spaces[0] and spaces[0] == spaces[1], spaces
    assert "Radix cache is enabled for decode server" in sglang_log(decode)
