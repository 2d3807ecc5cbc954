#!/usr/bin/env bash
# lm-evaluation-harness against `microbatch serve`: a multiple-choice (loglikelihood) task and a
# generate_until task from the local files here, run once through lm-eval's own `hf` backend on
# the tiny model's folder and once through `local-completions` against the server; compare.py
# then fails if any per-document, per-choice log-likelihood differs by more than 1e-3 or any
# generation differs. Offline: lm-eval comes from the package registry, data from this folder.
#
#   benchmarks/lm_eval/run.sh            (from the repository root; ~4 min the first time)
#
# LMEVAL_VENV (default /tmp/lmeval-venv) holds lm-eval apart from the project's own .venv.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
VENV=${LMEVAL_VENV:-/tmp/lmeval-venv}
WORK=$(mktemp -d /tmp/microbatch-lmeval.XXXXXX)
PORT=${PORT:-8177}
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

if [ ! -x "$VENV/bin/lm_eval" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q torch==2.13.0 'lm-eval[api]==0.4.13' transformers accelerate
fi
mkdir -p "$WORK/tasks"
for task in "$HERE"/tasks/*.yaml; do
  sed "s#__DATA__#$HERE/data#" "$task" > "$WORK/tasks/$(basename "$task")"
done
"$ROOT/.venv/bin/microbatch" tiny-model "$WORK/tiny"

MICROBATCH_SERVED_MODEL_NAME=tiny "$ROOT/.venv/bin/microbatch" serve \
  --model "$WORK/tiny" --port "$PORT" > "$WORK/serve.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 120); do
  curl -sf "http://127.0.0.1:$PORT/readyz" > /dev/null && break
  sleep 1
done

TASKS=(--tasks tiny_mc,tiny_gen --include_path "$WORK/tasks" --log_samples)
time "$VENV/bin/lm_eval" --model hf --model_args "pretrained=$WORK/tiny,dtype=float32" \
  --device cpu "${TASKS[@]}" --output_path "$WORK/out-hf"
ARGS="model=tiny,base_url=http://127.0.0.1:$PORT/v1/completions,tokenizer_backend=huggingface"
ARGS+=",tokenizer=$WORK/tiny,num_concurrent=1,max_retries=1,tokenized_requests=True"
ARGS+=",max_length=1024"
time "$VENV/bin/lm_eval" --model local-completions --model_args "$ARGS" \
  "${TASKS[@]}" --output_path "$WORK/out-server"
"$VENV/bin/python" "$HERE/compare.py" "$WORK/out-hf" "$WORK/out-server"
