#!/usr/bin/env bash
# kvgate bench serve: kvgate (local backend) vs llama-cpp-python's server, same GGUF, one run.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
MODEL=$($BIN/python -c "from gateway.backends.default_model import default_model_path; print(default_model_path())")
OUT=docs/perf
ADMIN=kvg-bench-admin-aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa
W=$(mktemp -d)
cat > $W/kvgate.toml <<TOML
[[backends]]
name = "local"
type = "local"
model = "$MODEL"
served_model_name = "gemma-3-270m"
n_ctx = 8192
n_parallel = 8
n_threads = 1
n_batch = 512
TOML
ARGS="--dataset random --num-prompts 32 --max-concurrency 8 --input-len 64 --output-len 64 --range-ratio 0 --temperature 0 --seed 0 --no-progress"
KVGATE_ADMIN_KEY=$ADMIN KVGATE_DATABASE_URL=sqlite+aiosqlite:///$W/kv.db $BIN/kvgate --config $W/kvgate.toml serve --port 8131 > $W/kvgate.log 2>&1 &
KV=$!
for i in $(seq 120); do curl -sf localhost:8131/health >/dev/null && break; sleep 0.5; done
H="Authorization: Bearer $ADMIN"
T=$(curl -s localhost:8131/admin/tenants -H "$H" --json '{"name":"bench"}' | $BIN/python -c "import sys,json;print(json.load(sys.stdin)['id'])")
K=$(curl -s localhost:8131/admin/tenants/$T/keys -H "$H" --json '{}' | $BIN/python -c "import sys,json;print(json.load(sys.stdin)['key'])")
$BIN/kvgate bench serve --url http://127.0.0.1:8131 --api-key $K --model gemma-3-270m $ARGS --save-result $OUT/serve_kvgate_local.json
kill $KV; wait $KV || true
$BIN/python -m llama_cpp.server --model $MODEL --model_alias gemma-3-270m --n_ctx 1024 --n_threads 1 --n_threads_batch 1 --n_batch 512 --interrupt_requests False --port 8132 > $W/lcs.log 2>&1 &
LC=$!
for i in $(seq 120); do curl -sf localhost:8132/v1/models >/dev/null && break; sleep 0.5; done
$BIN/kvgate bench serve --url http://127.0.0.1:8132 --api-key none --model gemma-3-270m $ARGS --save-result $OUT/serve_llama_cpp_server.json
kill $LC; wait $LC || true
