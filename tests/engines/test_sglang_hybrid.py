"""SGLang 0.5.23 on the two tiny hybrid presets of examples/make_tiny_model.py, CPU.

- ``hybrid-ssm`` (Qwen3-Next: three gated-delta-net layers and one full-attention layer): SGLang
  refuses it at start-up, before the model loads, with or without HiCache and whatever the storage
  backend: with a page size above 1 (or the overlap scheduler on) it resolves
  ``--mamba-radix-cache-strategy auto`` to ``extra_buffer``, which it allows on CUDA, MUSA, NPU, HIP
  and XPU only (sglang/srt/arg_groups/mamba_hook.py, ``validate_mamba_extra_buffer``). The other
  strategy, ``no_buffer`` (``--page-size 1 --disable-overlap-schedule``), gets further but needs
  the GDN kernels of sgl-kernel's CPU build (``sgl_kernel.mamba``), which neither PyPI nor the
  test shims provide (and ``--json-model-override-args '{"full_attention_interval": 4}'``, since
  SGLang's own Qwen3NextConfig derives the layer kinds from that key, not from ``layer_types``).
  kvstrata's backend is never built. The test fails once SGLang starts such a server.
- ``hybrid-swa`` (Gemma 3 text: three sliding-window layers of 256 and one full-attention layer):
  SGLang serves it, but turns its hybrid SWA memory off for every Gemma 2/3 model ("not yet
  supported", sglang/srt/arg_groups/model_overrides/gemma2_gemma3.py): one KV pool holds every
  layer's KV for every token (the windows are applied in the attention mask), so HiCache and its
  storage backend see a dense model. With StrataStorage a prompt comes back from storage after
  ``/flush_cache`` with the cold run's output (SGLang's own ``file`` backend does the same). The
  test fails once SGLang gives the model hybrid SWA pools, which would reach StrataStorage through
  the multi-pool interface (``register_mem_host_pool_v2``, then ``batch_*_v2``): StrataStorage
  refuses those pools at attach time with a clear error (sglang_storage_cases.py), rather than
  restore attention KV without their state.

One server at a time, each killed at the end; the SSM start fails in about 10 s.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from engines.launchers import (PAGE, SGLANG_REQUEST_TIMEOUT, SGLANG_START_TIMEOUT, ids, needs_sglang, sglang_args, sglang_config,
                              sglang_generate, sglang_python, tiny_model)
from tests.harness.sglang_server import SGLangServer, SGLangUnavailable, cpu_env

# Starts take longer on 2 cores shared with the other test worker (as in test_sglang.py).
pytestmark = [needs_sglang, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]


def server(model: str, config: Path | None, log: Path, extra: list[str], env: dict[str, str] | None = None,
           start_timeout: float = SGLANG_START_TIMEOUT) -> SGLangServer:
    """The tests' CPU server (``sglang_args``: page 16, HiCache with ratio 2) and ``extra`` flags."""
    return SGLangServer(sglang_python(), sglang_args(model, config) + extra, log,
                        {**cpu_env(ROOT / ".cache" / "sglang"), **(env or {})}, start_timeout=start_timeout,
                        request_timeout=SGLANG_REQUEST_TIMEOUT)


def test_sglang_refuses_the_ssm_hybrid_at_start_up_with_hicache_and_its_file_backend(tmp_path):
    s = server(tiny_model("hybrid-ssm"), None, tmp_path / "sglang.log", ["--hicache-storage-backend", "file"],
               {"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(tmp_path / "file")}, start_timeout=180)
    try:
        with pytest.raises(SGLangUnavailable, match="exited with 1"):
            s.__enter__()
    finally:
        s.stop()
    log = s.log_path.read_text(errors="replace")
    assert ("AssertionError: extra_buffer requires platform support for Mamba cache state snapshots."
            in log), log[-4000:]
    assert "validate_mamba_extra_buffer" in log and "Load weight begin" not in log  # refused before loading


def test_sglang_serves_the_swa_hybrid_as_a_dense_model_and_strata_storage_hits_with_its_output(tmp_path):
    config = sglang_config(tmp_path / "sglang.json", tmp_path / "l2")
    prompt = ids(11, 600)  # longer than the 256-token window
    with server(tiny_model("hybrid-swa"), config, tmp_path / "sglang.log", ["--skip-server-warmup"]) as s:
        cold = sglang_generate(s, prompt)
        deadline = time.monotonic() + 60  # backups to storage are asynchronous
        while len(list((tmp_path / "l2" / "blocks").glob("*/*.kvb"))) < len(prompt) // PAGE:
            assert time.monotonic() < deadline, "the prompt's pages did not reach kvstrata's disk tier"
            time.sleep(0.2)
        s.flush()
        again = sglang_generate(s, prompt)
    log = s.log_path.read_text(errors="replace")
    assert "Disable hybrid SWA memory for Gemma3ForCausalLM as it is not yet supported." in log, log[-4000:]
    assert "hybrid_swa=False" in log  # SGLang's tree cache: one dense pool
    assert "MHATokenToKVPoolHost:layer_first:[2, 4, " in log  # kvstrata's namespace: K/V of all 4 layers
    assert cold["storage"] == 0 and again["device"] == 0 and again["storage"] >= len(prompt) - PAGE, again
    assert again["tokens"] == cold["tokens"]
