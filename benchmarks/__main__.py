"""``python -m benchmarks {ttft,serve,remote}``, from the repository root: kvstrata beside the
baselines it competes with, in one run, with their ratios.

- ``ttft``: TTFT cold, vLLM's native prefix cache, kvstrata's L1, L2, shared tier and peer hits, and
  LMCache (``--engine vllm``); or SGLang's HiCache file backend beside kvstrata (``--engine sglang``).
- ``serve``: a trace replayed against real servers, each configuration beside the baselines.
- ``remote``: the Redis tier beside raw redis-py on the same server, invalidation latency.
- ``store-sglang``: SGLang's file backend beside kvstrata's StrataStorage, pages moved as SGLang's
  cache controller moves them (in ``./.venv-sglang`` when SGLang does not import here).
- ``decode``: decode throughput of vLLM without a connector beside kvstrata on a deliberately slow
  disk (a test-only trial planted into the server: saves never stall a step).
- ``image-keys``: kvstrata's content digest of a processed image beside vLLM's hash of the raw one.

The operator's own benchmarks (``store``, ``copy``, ``identity``, ``verify``) are ``kvstrata bench``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Sequence

from tests.harness.starts import count_engine_starts

count_engine_starts()  # a run under the tests counts its engines into the suite's tally


def _ttft(args: argparse.Namespace) -> int:
    from benchmarks.ttft import BenchError

    if args.engine == "sglang":
        from benchmarks.ttft_sglang import print_table, run
    else:
        from benchmarks.ttft import print_table, run
    try:
        summary = run(args)
    except BenchError as e:
        print(e, file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(summary))
    else:
        print_table(summary)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from benchmarks.serve import run

    return run(args)


def _remote(args: argparse.Namespace) -> int:
    from benchmarks.remote import run

    print(json.dumps(run(args.url, quick=args.quick)))
    return 0


def _store_sglang(args: argparse.Namespace) -> int:
    from benchmarks.store_sglang import sglang_fields

    result = sglang_fields(args.quick)
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    if "sglang_reason" in result:
        print(result["sglang_reason"], file=sys.stderr)
        return 2
    return 0


def _parser() -> argparse.ArgumentParser:
    from benchmarks import decode, image_keys, serve, ttft

    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="cmd", required=True)
    tt = sub.add_parser("ttft", help="TTFT cold vs native, L1, L2, peer and LMCache hits on one engine")
    ttft.add_arguments(tt)
    tt.set_defaults(handler=_ttft)
    sv = sub.add_parser("serve", help="trace replay against real servers, beside the baselines")
    serve.add_arguments(sv)
    sv.set_defaults(handler=_serve)
    rm = sub.add_parser("remote", help="the Redis tier beside raw redis-py, invalidation latency")
    rm.add_argument("--url", default=None, help="an existing server (default: start a private one)")
    rm.add_argument("--quick", action="store_true", help="fewer rounds")
    rm.add_argument("--json", action="store_true", help="only the JSON line (the default output)")
    rm.set_defaults(handler=_remote)
    sg = sub.add_parser("store-sglang", help="SGLang's file backend beside StrataStorage, in SGLang's environment")
    sg.add_argument("--quick", action="store_true", help="64 pages and 3 rounds instead of 256 and 5")
    sg.add_argument("--json", action="store_true", help="one JSON line (the default prints it indented)")
    sg.set_defaults(handler=_store_sglang)
    dc = sub.add_parser("decode", help="decode throughput with a slow disk tier, beside no connector")
    decode.add_arguments(dc)
    dc.set_defaults(handler=decode.run)
    ik = sub.add_parser("image-keys", help="content digest of a processed image beside vLLM's hash of the raw one")
    image_keys.add_arguments(ik)
    ik.set_defaults(handler=image_keys.run)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
