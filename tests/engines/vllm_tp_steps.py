"""Test scaffolding: one tensor-parallel vLLM engine (CPU) through a list of steps, JSON results.

Usage: python vllm_tp_steps.py SPEC.json. SPEC: {"model": DIR, "config": YAML or null (no
connector), "tp": int, "block_size": int, "module_path": the connector's module (default
kvstrata.adapters.vllm), "steps": [...]}. Steps:
{"op": "generate", "prompts": [[ids], ...], "max_tokens": n} -> {"tokens": [[ids], ...],
"cached": [n, ...]} (one batched call: the prompts share engine steps);
{"op": "reset"} -> {"ok"} (vLLM's own prefix cache only); {"op": "counters"} -> the connector's
counters; {"op": "arenas"} -> {"names"}: kvstrata's L1 arena files this process owns.
Greedy decoding throughout.

EngineCore runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so the scheduler-side
connector can be inspected; the tensor-parallel workers are separate processes, one per rank,
each bound to its own core (VLLM_CPU_OMP_THREADS_BIND "0|1": one CPU list per rank).
"""

import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    tp = spec.get("tp", 2)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(r % os.cpu_count()) for r in range(tp)))
    from vllm import LLM, SamplingParams

    ktc = None
    if spec.get("config"):
        ktc = {"kv_connector": "StrataConnector", "kv_role": "kv_both",
               "kv_connector_module_path": spec.get("module_path", "kvstrata.adapters.vllm"),
               "kv_connector_extra_config": {"config_file": spec["config"]},
               "kv_load_failure_policy": "recompute"}
    llm = LLM(model=spec["model"], enforce_eager=True, block_size=spec.get("block_size", 32),
              max_model_len=4096, kv_transfer_config=ktc, enable_prefix_caching=True, seed=0,
              tensor_parallel_size=tp)
    results = []
    for step in spec["steps"]:
        if step["op"] == "generate":
            params = SamplingParams(temperature=0, max_tokens=step.get("max_tokens", 8))
            outs = llm.generate([{"prompt_token_ids": p} for p in step["prompts"]], params, use_tqdm=False)
            results.append({"tokens": [list(o.outputs[0].token_ids) for o in outs],
                            "cached": [o.num_cached_tokens for o in outs]})
        elif step["op"] == "reset":
            results.append({"ok": llm.reset_prefix_cache()})
        elif step["op"] == "counters":
            sched = llm.llm_engine.engine_core.engine_core.scheduler
            results.append(sched.connector._sched.store.counters.snapshot())
        elif step["op"] == "arenas":
            pid = str(os.getpid())
            results.append({"names": sorted(n for n in os.listdir("/dev/shm")
                                            if n.startswith(f"kvstrata-{pid}-"))})
    print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
