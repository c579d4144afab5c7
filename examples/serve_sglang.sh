#!/usr/bin/env bash
# Start an SGLang server whose HiCache storage tier is kvstrata.
#   MODEL=/path/to/model CONFIG=configs/sglang.yaml PORT=30000 examples/serve_sglang.sh [extra flags]
# Needs SGLang and kvstrata in one environment (scripts/setup_sglang.sh makes ./.venv-sglang).
# Without CUDA it adds the CPU flags and the test-only shims of tests/engines/sglang_shims, which
# bridge what upstream SGLang lacks on a CPU "device" (see that folder; for trying things only).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
MODEL=${MODEL:-.cache/models/tiny}
CONFIG=${CONFIG:-configs/sglang.yaml}
PORT=${PORT:-30000}
HOST=${HOST:-127.0.0.1}
PYTHON=${PYTHON:-$( [ -x .venv-sglang/bin/python ] && echo .venv-sglang/bin/python || echo python3 )}

args=(--model-path "$MODEL" --host "$HOST" --port "$PORT" --page-size "${PAGE_SIZE:-16}"
      --enable-hierarchical-cache
      --hicache-storage-backend dynamic --hicache-storage-backend-extra-config "@$CONFIG")

if [ "$MODEL" = .cache/models/tiny ] && [ ! -f "$MODEL/config.json" ]; then
  "$PYTHON" examples/make_tiny_model.py "$MODEL" --preset tiny  # random weights, for trying things
fi

if ! "$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  export SGLANG_USE_CPU_ENGINE=1
  export PYTHONPATH="$ROOT/tests/engines/sglang_shims${PYTHONPATH:+:$PYTHONPATH}"
  export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$ROOT/.cache/sglang/torch_extensions}
  export SGLANG_CACHE_DIR=${SGLANG_CACHE_DIR:-$ROOT/.cache/sglang/cache}
  export HF_HUB_OFFLINE=1
  args+=(--device cpu --attention-backend torch_native --disable-cuda-graph
         --max-total-tokens "${MAX_TOTAL_TOKENS:-8192}" --hicache-ratio 2
         --hicache-io-backend direct --hicache-mem-layout layer_first
         --sleep-on-idle)  # as tests.harness.sglang_server.cpu_flags: an idle scheduler would spin a core
fi

exec "$PYTHON" -m sglang.launch_server "${args[@]}" "$@"
