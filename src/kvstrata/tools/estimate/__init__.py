"""``kvstrata estimate``: a transparent model of the TTFT and throughput gains of kvstrata.

One representative request; its formulas and assumptions are in ``model.py``. Every input is
printed with where it came from (a flag, a file and key, a default, or the formula that derived
it), then the intermediate numbers. With ``--measured`` (``bench serve --json``), each kvstrata
configuration is predicted from its own measured hit mix and compared with what was measured. Bad
input files are a ``ValueError`` naming the file, key and value.

Modules: ``inputs`` (every input and its source), ``model`` (the formulas), ``report`` (text,
JSON and the comparison with ``--measured``); this one is the command.
"""

from __future__ import annotations

import argparse
import json
import sys

from kvstrata.tools.estimate.inputs import DEFAULT_MFU, Gather, Input, load_json, load_model_shape
from kvstrata.tools.estimate.model import TIERS, EstimateError, Hits, ModelShape, Params, Prediction, predict
from kvstrata.tools.estimate.report import Estimate, as_dict, compare, print_text

__all__ = ["EstimateError", "Estimate", "Hits", "Input", "ModelShape", "Params", "Prediction", "add_arguments",
           "build", "load_json", "load_model_shape", "predict", "run"]


def build(args: argparse.Namespace) -> Estimate:
    """Gather every input with its source, run the model, compare with ``--measured``."""
    g = Gather(args)
    g.workload()
    model = g.model()
    g.prefill(model)
    g.tiers()
    hits, hit_flags = g.hits()
    params = g.params()
    prediction = predict(params, hits)
    hits_source = ", ".join(sorted({g.inputs[f"hit_{t}"].source for t in TIERS}))
    comparison = compare(g.measured, params, hits, hits_source, hit_flags) if g.measured else []
    return Estimate(g.inputs, params, hits, hits_source, prediction, comparison, g.notes)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model")
    g.add_argument("--model-config", help="model folder or its config.json (KV bytes per token, FLOPs)")
    g.add_argument("--kv-dtype", help="KV cache dtype if not the model's (e.g. fp8)")
    g.add_argument("--kv-bytes-per-token", type=float, help="instead of --model-config")
    g = parser.add_argument_group("compute")
    g.add_argument("--prefill-tok-s", type=float, help="prefill tokens/s of one request")
    g.add_argument("--ttft-json", help="`python -m benchmarks ttft --json` output: prefill rate and overhead")
    g.add_argument("--overhead-ms", type=float, help="fixed per-request cost (default: bench ttft's fastest "
                                                     "full hit, else 0)")
    g.add_argument("--peak-tflops", type=float, help="without a measured rate: peak dense TFLOP/s")
    g.add_argument("--mfu", type=float, help=f"fraction of --peak-tflops prefill reaches (default {DEFAULT_MFU})")
    g.add_argument("--decode-tok-s", type=float, help="decode tokens/s of the whole server (default: "
                                                      "calibrated on the --measured baseline, else not modeled)")
    g = parser.add_argument_group("tiers")
    g.add_argument("--store-json", help="`kvstrata bench store --json` output: L1 and L2 GB/s, lookup time")
    g.add_argument("--remote-json", help="`python -m benchmarks remote --json` output: L3 GB/s")
    for t in TIERS:
        g.add_argument(f"--{t}-gbps", type=float, help=f"{t.upper()} load bandwidth, GB/s")
    g.add_argument("--no-staging", dest="staging", action="store_false",
                   help="L2/L3 loads go straight to the engine (default: staged through L1, as in vLLM)")
    g.add_argument("--overlap", action="store_true", help="loads overlap compute (default: serial)")
    g = parser.add_argument_group("hits and workload")
    g.add_argument("--simulate-json", help="`kvstrata simulate --json` output: hit rate per tier")
    for t in TIERS:
        g.add_argument(f"--hit-{t}", type=float, help=f"fraction of prompt tokens loaded from {t.upper()}")
    g.add_argument("--hit-device", type=float, help="fraction served by the engine's own prefix cache, in both "
                                                    "runs (default: the --measured baseline's, else 0)")
    g.add_argument("--prompt-tokens", type=float, help="P (default: --measured workload, else --ttft-json)")
    g.add_argument("--output-tokens", type=float, help="O (default: --measured workload, else 0)")
    g.add_argument("--block-tokens", type=float, help="tokens per KV block (default: --measured, "
                                                      "--ttft-json, else 128)")
    parser.add_argument("--measured", help="`python -m benchmarks serve --json` output to compare with")
    parser.add_argument("--json", action="store_true", help="one JSON object")


def run(args: argparse.Namespace) -> int:
    try:
        est = build(args)
    except EstimateError as e:
        print(f"kvstrata estimate: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(as_dict(est)))
    else:
        print_text(est)
    return 0
