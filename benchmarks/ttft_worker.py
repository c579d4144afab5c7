"""One engine process of ``python -m benchmarks ttft``: run a list of steps, write one JSON result.

Usage: ``python -m benchmarks.ttft_worker SPEC.json``. The spec names the model, the
prompt and warm-up token ids, the engine options and the steps, each one of: ``warmup`` (untimed
request on the warm-up prompt, then the same pause as ``store``), ``store`` (untimed request on the
prompt, then a short pause so asynchronous saves can land), ``reset``
(``llm.reset_prefix_cache()``), ``time`` (timed greedy ``max_tokens=1`` request on the prompt: wall
ms, and CPU ms of this process, which holds the whole engine when VLLM_ENABLE_V1_MULTIPROCESSING=0)
and ``output`` (greedy ``max_tokens=N`` request whose token ids are kept). The result is written to
the spec's ``result_path`` (not stdout, which engine subprocesses share).
"""

from __future__ import annotations

import json
import os
import sys
import time


def main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    from vllm import LLM, SamplingParams

    from tests.harness.starts import note_start

    note_start("vllm offline engine")

    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], enforce_eager=True, block_size=spec["block_size"],
              enable_prefix_caching=spec["prefix_caching"], seed=0, dtype=spec.get("dtype", "auto"),
              kv_transfer_config=spec["kv_transfer_config"])
    result = {"engine_start_s": round(time.perf_counter() - t0, 2), "samples_ms": [], "cpu_ms": [],
              "cached_tokens": [], "output": None, "output_cached_tokens": None, "other_ms": {}}
    prompt, warm = {"prompt_token_ids": spec["prompt"]}, {"prompt_token_ids": spec["warmup"]}
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    many = SamplingParams(temperature=0.0, max_tokens=spec["output_tokens"], ignore_eos=True)

    def generate(p, sp):
        t, c = time.perf_counter(), time.process_time()
        out = llm.generate([p], sp, use_tqdm=False)[0]
        return round((time.perf_counter() - t) * 1e3, 2), round((time.process_time() - c) * 1e3, 1), out

    for step in spec["steps"]:
        if step == "warmup":
            result["other_ms"]["warmup"] = generate(warm, one)[0]
            time.sleep(spec["settle_s"])  # its saves land before anything is timed
        elif step == "store":
            result["other_ms"]["store"] = generate(prompt, one)[0]
            time.sleep(spec["settle_s"])
        elif step == "reset":
            if not llm.reset_prefix_cache():
                raise RuntimeError("reset_prefix_cache() returned False")
        elif step == "time":
            ms, cpu, out = generate(prompt, one)
            result["samples_ms"].append(ms)
            result["cpu_ms"].append(cpu)
            result["cached_tokens"].append(out.num_cached_tokens)
        elif step == "output":
            out = generate(prompt, many)[2]
            result["output"] = list(out.outputs[0].token_ids)
            result["output_cached_tokens"] = out.num_cached_tokens
        else:
            raise ValueError(f"unknown step {step!r}")
    with open(spec["result_path"] + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(spec["result_path"] + ".tmp", spec["result_path"])


if __name__ == "__main__":
    main(sys.argv[1])
