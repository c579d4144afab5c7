"""Test scaffolding: runs one vLLM engine (CPU) through a list of steps and prints JSON results.

Usage: python vllm_steps.py SPEC.json. SPEC: {"model": DIR, "config": YAML or null (no connector),
"mp": bool (separate EngineCore/worker processes), "block_size": int, "steps": [...]}. Steps:
{"op": "generate", "prompt": [ids], "max_tokens": n, "salt": str|null} -> {"tokens", "cached", "ms"};
{"op": "reset", "connector": bool} -> {"ok"}; {"op": "counters"} -> the connector's counters, once the background L2 scan is done
(in-process engines only); {"op": "signal", "file": path} creates a file; {"op": "wait", "file":
path} waits for one (to coordinate with the test or another engine); {"op": "sleep", "s": x};
{"op": "arenas"} -> {"names"}: kvstrata's L1 arena files in /dev/shm owned by this process or its
children (the EngineCore when "mp").
Greedy decoding throughout.
"""

import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def _own_arenas() -> list[str]:
    """Arena files (``kvstrata-PID-...``) whose PID is this process or one of its children."""
    pids = {os.getpid()}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == os.getpid():
                pids.add(int(entry))
    return sorted(n for n in os.listdir("/dev/shm")
                  if n.startswith("kvstrata-") and n.split("-")[1].isdigit() and int(n.split("-")[1]) in pids)


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    if not spec.get("mp"):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    ktc = None
    if spec.get("config"):
        ktc = {"kv_connector": "StrataConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": {"config_file": spec["config"]},
               "kv_load_failure_policy": "recompute"}
        if spec.get("module_path", True):
            ktc["kv_connector_module_path"] = "kvstrata.adapters.vllm"
    llm = LLM(model=spec["model"], enforce_eager=True, block_size=spec.get("block_size", 32),
              max_model_len=4096, kv_transfer_config=ktc, enable_prefix_caching=True, seed=0)
    results = []
    for step in spec["steps"]:
        if step["op"] == "generate":
            prompt = {"prompt_token_ids": step["prompt"]}
            if step.get("salt"):
                prompt["cache_salt"] = step["salt"]
            params = SamplingParams(temperature=0, max_tokens=step.get("max_tokens", 8))
            start = time.perf_counter()
            out = llm.generate([prompt], params, use_tqdm=False)[0]
            results.append({"tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens,
                            "ms": (time.perf_counter() - start) * 1000})
        elif step["op"] == "reset":
            results.append({"ok": llm.reset_prefix_cache(reset_connector=step.get("connector", False))})
        elif step["op"] == "signal":
            open(step["file"], "w").close()
            results.append({})
        elif step["op"] == "wait":
            deadline = time.monotonic() + step.get("timeout", 300)
            while not os.path.exists(step["file"]):
                if time.monotonic() > deadline:
                    raise TimeoutError(step["file"])
                time.sleep(0.05)
            results.append({})
        elif step["op"] == "sleep":
            time.sleep(step["s"])
            results.append({})
        elif step["op"] == "arenas":
            results.append({"names": _own_arenas()})
        elif step["op"] == "counters":
            store = llm.llm_engine.engine_core.engine_core.scheduler.connector._sched.store
            store.wait_recovered(120)  # settled figures: the background L2 scan's counts included
            results.append(store.counters.snapshot())
    print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
