#!/usr/bin/env bash
# Prefill/decode split through kvstrata's shared tier: Redis, one prefill vLLM server (kv_producer,
# prefill.yaml), one decode vLLM server (kv_consumer, decode.yaml) and the router in front of them.
# A prompt sent to the router is computed by the prefill server and published to Redis, then loaded
# by the decode server, which streams the answer. Override MODEL, PORT_PREFILL, PORT_DECODE,
# PORT_ROUTER; SERVE=1 keeps everything up after the demo request (Ctrl-C stops it). Redis is on
# port 6390, as both YAML files say.
set -euo pipefail
cd "$(dirname "$0")/../.."
MODEL=${MODEL:-.cache/models/tiny}
PY=${PYTHON:-.venv/bin/python}
PORT_PREFILL=${PORT_PREFILL:-8001} PORT_DECODE=${PORT_DECODE:-8002} PORT_ROUTER=${PORT_ROUTER:-8000}
WORK=$(mktemp -d /tmp/kvstrata-disagg-XXXX)
[ -e "$MODEL" ] || "$PY" examples/make_tiny_model.py "$MODEL" --preset tiny

redis-server --port 6390 --bind 127.0.0.1 --save '' --appendonly no \
  --maxmemory 2gb --maxmemory-policy allkeys-lru --daemonize yes --pidfile "$WORK/redis.pid"
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; kill "$(cat "$WORK/redis.pid")" 2>/dev/null || true; }
trap cleanup EXIT

MODEL=$MODEL ROLE=kv_producer CONFIG=examples/disagg/prefill.yaml PORT=$PORT_PREFILL \
  examples/serve_vllm.sh > "$WORK/prefill.log" 2>&1 & pids+=($!)
MODEL=$MODEL ROLE=kv_consumer CONFIG=examples/disagg/decode.yaml PORT=$PORT_DECODE \
  examples/serve_vllm.sh > "$WORK/decode.log" 2>&1 & pids+=($!)
for port in $PORT_PREFILL $PORT_DECODE; do
  until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do sleep 1; done
done
"$PY" examples/disagg/router.py --port "$PORT_ROUTER" --prefill "http://127.0.0.1:$PORT_PREFILL" \
  --decode "http://127.0.0.1:$PORT_DECODE" > "$WORK/router.log" 2>&1 & pids+=($!)
until curl -sf "http://127.0.0.1:$PORT_ROUTER/health" >/dev/null; do sleep 0.2; done
echo "router on http://127.0.0.1:$PORT_ROUTER (logs in $WORK)"

"$PY" - "$MODEL" "$PORT_ROUTER" <<'PYEOF'
import json, random, sys, urllib.request
model, port = sys.argv[1], sys.argv[2]
prompt = [random.Random(0).randrange(100, 2000) for _ in range(2000)]
body = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}}
req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                             {"Content-Type": "application/json"})
text, cached = "", None
for line in urllib.request.urlopen(req):
    line = line.decode().strip()
    if line.startswith("data: {"):
        chunk = json.loads(line[6:])
        text += "".join(c.get("text", "") for c in chunk.get("choices", []))
        cached = ((chunk.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens", cached)
print(f"decode instance: {cached} of {len(prompt)} prompt tokens loaded, not computed; text {text!r}")
PYEOF
if [ "${SERVE:-0}" = 1 ]; then wait; fi
