#!/usr/bin/env bash
# Redis plus two vLLM servers sharing it through kvstrata's remote tier, each with its own CPU and
# disk tiers. A long prompt sent to A is then answered by B from Redis. Override MODEL, PORT_*.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-.cache/models/tiny}
PY=${PYTHON:-.venv/bin/python}
PORT_REDIS=${PORT_REDIS:-6390} PORT_A=${PORT_A:-8001} PORT_B=${PORT_B:-8002}
WORK=$(mktemp -d /tmp/kvstrata-two-XXXX)
[ -e "$MODEL" ] || "$PY" examples/make_tiny_model.py "$MODEL" --preset tiny

redis-server --port "$PORT_REDIS" --bind 127.0.0.1 --save '' --appendonly no \
  --maxmemory 2gb --maxmemory-policy allkeys-lru --daemonize yes --pidfile "$WORK/redis.pid"
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; kill "$(cat "$WORK/redis.pid")" 2>/dev/null || true; }
trap cleanup EXIT

for name in a b; do
  cat > "$WORK/$name.yaml" <<YAML
l1:
  size: 1GiB
l2:
  path: $WORK/$name-l2
remote:
  enabled: true
  backend: redis
  url: redis://127.0.0.1:$PORT_REDIS/0
YAML
done
MODEL=$MODEL CONFIG=$WORK/a.yaml PORT=$PORT_A examples/serve_vllm.sh > "$WORK/a.log" 2>&1 & pids+=($!)
MODEL=$MODEL CONFIG=$WORK/b.yaml PORT=$PORT_B examples/serve_vllm.sh > "$WORK/b.log" 2>&1 & pids+=($!)
for port in $PORT_A $PORT_B; do
  until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do sleep 1; done
done

"$PY" - "$MODEL" "$PORT_A" "$PORT_B" <<'PYEOF'
import json, random, sys, urllib.request
model, ports = sys.argv[1], sys.argv[2:]
prompt = [random.Random(0).randrange(100, 2000) for _ in range(2000)]
for name, port in zip("AB", ports):
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    out = json.load(urllib.request.urlopen(req))
    cached = (out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
    print(f"instance {name}: {cached} of {len(prompt)} prompt tokens cached; text {out['choices'][0]['text']!r}")
PYEOF
