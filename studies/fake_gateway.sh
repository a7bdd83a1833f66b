#!/usr/bin/env bash
# kvgate on its fake backend, measured by `kvgate bench`: the gateway alone (auth, quotas,
# usage accounting, SSE), no model. Writes results into OUT (default docs/perf).
#
#   1. unpaced: the fake backend answers at once, so the numbers are the gateway's own ceiling;
#   2. paced (TTFT 50 ms, 50 tok/s per request): a concurrency sweep, SQLite-backed gateway vs
#      a PostgreSQL-backed one on the same plot; anything above 50 ms TTFT / 20 ms TPOT is
#      the gateway's overhead.
#
# Needs curl; the PostgreSQL half runs only when PG_URL answers (default: the test server).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-docs/perf}
PG_URL=${PG_URL:-postgresql+asyncpg://postgres@127.0.0.1:5432/test}
KVGATE=${KVGATE:-.venv/bin/kvgate}
WORK=$(mktemp -d)
ADMIN=sk-admin-bench
SCHEMA=kvgate_bench_$$
PIDS=()
pg() {  # run one SQL statement on PG_URL
  .venv/bin/python -c "import asyncio, asyncpg, sys
async def main():
    conn = await asyncpg.connect(sys.argv[1].replace('+asyncpg', ''), timeout=3)
    await conn.execute(sys.argv[2])
    await conn.close()
asyncio.run(main())" "$PG_URL" "$1"
}
cleanup() {
  kill "${PIDS[@]}" 2>/dev/null || true
  wait 2>/dev/null || true
  if [ -n "${PG_USED:-}" ]; then pg "DROP SCHEMA IF EXISTS $SCHEMA CASCADE"; fi
  rm -rf "$WORK"
}
trap cleanup EXIT
mkdir -p "$OUT"

cat > "$WORK/paced.toml" <<'EOF'
[[backends]]
name = "fake"
type = "fake"
options = { ttft_ms = 50, tokens_per_second = 50 }
EOF

start_gateway() {  # name port kvgate-args... (ending in `serve ...`); waits for /health
  local name=$1 port=$2
  shift 2
  KVGATE_ADMIN_KEY=$ADMIN "$KVGATE" "$@" --port "$port" >"$WORK/$name.log" 2>&1 &
  PIDS+=($!)
  for _ in $(seq 100); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && return 0
    sleep 0.2
  done
  cat "$WORK/$name.log"
  return 1
}

make_keys() {  # port file: four tenants, one inference key each
  local port=$1 file=$2 id
  : >"$file"
  for t in a b c d; do
    id=$(curl -sf -X POST "http://127.0.0.1:$port/admin/tenants" -H "Authorization: Bearer $ADMIN" \
      -H 'Content-Type: application/json' -d "{\"name\": \"bench-$t-$RANDOM\"}" |
      python3 -c 'import json, sys; print(json.load(sys.stdin)["id"])')
    curl -sf -X POST "http://127.0.0.1:$port/admin/tenants/$id/keys" -H "Authorization: Bearer $ADMIN" \
      -H 'Content-Type: application/json' -d '{"name": "bench"}' |
      python3 -c 'import json, sys; print(json.load(sys.stdin)["key"])' >>"$file"
  done
}

# 1. unpaced, SQLite
start_gateway unpaced 8461 --database-url "sqlite+aiosqlite:///$WORK/unpaced.db" serve --backend fake
make_keys 8461 "$WORK/keys-unpaced"
"$KVGATE" bench serve --url http://127.0.0.1:8461 --api-key-file "$WORK/keys-unpaced" \
  --num-tenants 4 --num-prompts 400 --input-len 128 --output-len 64 --ignore-eos \
  --max-concurrency 32 --save-result "$OUT/bench_serve_fake_unpaced.json"

# 2. paced sweep, SQLite vs PostgreSQL
start_gateway sqlite 8462 --database-url "sqlite+aiosqlite:///$WORK/paced.db" \
  --config "$WORK/paced.toml" serve
make_keys 8462 "$WORK/keys-sqlite"
SECOND=()
if pg "SELECT 1" 2>/dev/null; then
  PG_USED=1
  start_gateway postgres 8463 --database-url "$PG_URL" --database-schema "$SCHEMA" \
    --config "$WORK/paced.toml" serve
  make_keys 8463 "$WORK/keys-postgres"
  SECOND=(--url2 http://127.0.0.1:8463 --api-key-file2 "$WORK/keys-postgres" --label2 "kvgate, PostgreSQL")
fi
"$KVGATE" bench sweep --url http://127.0.0.1:8462 --api-key-file "$WORK/keys-sqlite" \
  --label "kvgate, SQLite" "${SECOND[@]}" --num-tenants 4 --concurrency 1,4,16,64 \
  --prompts-per-concurrency 4 --input-len 128 --output-len 32 --ignore-eos \
  --save-result "$OUT/bench_sweep_fake_paced.json" --plot "$OUT/bench_sweep_fake_paced.png"
