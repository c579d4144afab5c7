#!/usr/bin/env bash
# The checks that need a GPU, on a machine that has torch and CUDA but not kvstrata's environment:
# tests/worker/test_copy.py (its CUDA cases) and `kvstrata bench copy --device cuda`.
#
#   scripts/gpu_check.sh prepare   here: kvstrata's pure-Python needs beyond torch as wheels in .whl/
#                                  (pydantic and its parts, the versions of ./.venv; add .whl to
#                                  .git/info/exclude and carry it to the GPU machine)
#   scripts/gpu_check.sh run       there, in the checkout's root: install .whl/ into /tmp/site, put
#                                  src/ on the path (the kvstrata package), run the tests and the bench;
#                                  outputs also under $OUT when it is set
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  prepare)
    versions=$(.venv/bin/python -m pip list --format=freeze 2>/dev/null |
               grep -iE '^(pydantic|pydantic.core|annotated.types|typing.inspection)==')
    # shellcheck disable=SC2086
    .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 -d .whl $versions
    ls .whl ;;
  run)
    out=${OUT:-/tmp/gpu-check}; mkdir -p "$out"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
    status=0  # the benchmark runs even when a test failed; the exit status says whether anything did
    timeout 150 python3 -m pytest --noconftest -p no:cacheprovider -q -rA tests/worker/test_copy.py 2>&1 |
      tee "$out/tests.txt" || status=1
    bench='import sys; from kvstrata.cli.main import main; sys.exit(main(sys.argv[1:]))'
    timeout 150 python3 -c "$bench" bench copy --device cuda 2>&1 | tee "$out/bench.txt" || status=1
    timeout 150 python3 -c "$bench" bench copy --device cuda --hit 256 --rounds 10 2>&1 |
      tee "$out/bench_hit256.txt" || status=1
    exit $status ;;
  *) echo "usage: $0 prepare|run" >&2; exit 2 ;;
esac
