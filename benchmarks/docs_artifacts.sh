#!/usr/bin/env bash
# Regenerates docs/data/bench.png, docs/data/bench.json, docs/data/status.txt and docs/data/tune.* on this machine:
# one redis-server, one gateway, one worker with the default model, loaded by `microbatch bench`
# and swept by `microbatch tune`.   Run from the repository root: bash benchmarks/docs_artifacts.sh
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
PORT=${REDIS_PORT:-6399}
GW=${GATEWAY_PORT:-8099}
export MICROBATCH_REDIS_URL="redis://127.0.0.1:${PORT}/0" MICROBATCH_LOG_LEVEL=warning HF_HUB_OFFLINE=1
redis-server --port "$PORT" --save "" --appendonly no --daemonize yes >/dev/null
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; redis-cli -p "$PORT" shutdown nosave >/dev/null 2>&1 || true; }
trap cleanup EXIT
$BIN/microbatch worker --metrics-port 9199 >/tmp/mb-docs-worker.log 2>&1 & pids+=($!)
$BIN/microbatch gateway --port "$GW" >/tmp/mb-docs-gateway.log 2>&1 & pids+=($!)
until curl -sf "http://127.0.0.1:${GW}/readyz" >/dev/null; do sleep 0.5; done

mkdir -p docs
# The status screen, taken while the mixed workload is queued.
( sleep 10; COLUMNS=140 $BIN/microbatch status > docs/data/status.txt ) & status_pid=$!
$BIN/microbatch bench --url "http://127.0.0.1:${GW}" --workload mixed --clients 32 --duration 20 \
  --metrics-url http://127.0.0.1:9199 --json docs/data/bench.json --plot docs/data/bench.png | tee docs/data/bench.txt
wait "$status_pid"
PYTHONUNBUFFERED=1 $BIN/microbatch tune --url "http://127.0.0.1:${GW}" --workload short --rate 80 --duration 8 \
  --p99-target-ms 500 --json docs/data/tune.json --plot docs/data/tune.png | tee docs/data/tune.txt
