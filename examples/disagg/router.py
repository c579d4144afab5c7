"""The prefill/decode router of examples/disagg/run.sh: kvstrata's ``kvstrata.tools.pd_router``.

    python examples/disagg/router.py --prefill http://127.0.0.1:8001 --decode http://127.0.0.1:8002 --port 8000

Each /v1/completions or /v1/chat/completions request goes to a prefill instance with max_tokens 1
(its answer comes once the prompt's blocks are in the shared tier), then unchanged to a decode
instance, whose streamed answer is passed through as it comes. The code is in the package so that
`python -m benchmarks serve --disagg` and the tests run the same router.
"""

from kvstrata.tools.pd_router import main

if __name__ == "__main__":
    main()
