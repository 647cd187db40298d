#!/usr/bin/env bash
# Peer comparison (issue #7 §3): the same trace slice through FlexLB (cost + batching),
# FlexLB (round_robin + batching), sglang-router (cache_aware) and vllm-router (cache_aware), all
# in P/D mode over simulated GPUs with the same engine core, profile and time scale 1. FlexLB runs
# its Triton workers; the peers run the HTTP facade (workers/http_facade) over the same core.
# Writes one results folder per system and comparison.md (one table). Everything binds 127.0.0.1.
#
#   bench/compare_routers.sh                    # defaults below; env vars override them
#   SLICE=7000:7200 SPEED=0.5 bench/compare_routers.sh
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=$ROOT/.venv/bin/python
TRACE=${TRACE:-$ROOT/data/traces/trace_30min.jsonl.gz}
SLICE=${SLICE:-7000:7300}
SPEED=${SPEED:-0.5}          # 2 prefill GPUs at ~70% of their no-cache prefill capacity on that slice
MAX_OUT=${MAX_OUT:-256}      # clip outputs so a run drains in seconds, not minutes
PREFILL=${PREFILL:-2}
DECODE=${DECODE:-2}
PROFILE=${PROFILE:-llama3.1-8b-h100}
SLO_MS=${SLO_MS:-2000}
SYSTEMS=${SYSTEMS:-"flexlb-cost flexlb-rr sglang vllm"}
OUT=${OUT:-$ROOT/bench/results/compare-$(date +%Y%m%d-%H%M%S)}
PEER_PKGS=${PEER_PKGS:-"sglang-router==0.3.2 vllm-router==0.1.17"}
# Extra router flags (word-split), e.g. PEER_ARGS="--prefill-policy cache_aware --decode-policy round_robin"
# or VLLM_ARGS="--cache-threshold 0.5 --balance-abs-threshold 32 --balance-rel-threshold 1.1"
PEER_ARGS=${PEER_ARGS:-}
SGLANG_ARGS=${SGLANG_ARGS:-}
VLLM_ARGS=${VLLM_ARGS:-}
TOKEN=compare-$$
mkdir -p "$OUT/logs"

if [ ! -x .venv-peers/bin/sglang-router ] || [ ! -x .venv-peers/bin/vllm-router ]; then
  echo "installing the peer routers into .venv-peers ($PEER_PKGS)"
  python3 -m venv .venv-peers
  # shellcheck disable=SC2086
  .venv-peers/bin/pip install -q $PEER_PKGS
fi

PIDS=()
cleanup() {
  for p in "${PIDS[@]:-}"; do [ -n "$p" ] && kill "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]:-}"; do [ -n "$p" ] && wait "$p" 2>/dev/null || true; done
  PIDS=()
}
trap cleanup EXIT INT TERM

free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

wait_line() {  # wait_line FILE PATTERN SECONDS
  local i
  for ((i = 0; i < $3 * 10; i++)); do grep -q "$2" "$1" 2>/dev/null && return 0; sleep 0.1; done
  echo "timed out waiting for '$2' in $1" >&2; tail -20 "$1" >&2; return 1
}

wait_http() {  # wait_http URL SECONDS
  local i
  for ((i = 0; i < $2 * 10; i++)); do curl -sf -o /dev/null "$1" && return 0; sleep 0.1; done
  echo "timed out waiting for $1" >&2; return 1
}

bench() {  # bench NAME URL [extra flexlb bench args...]
  local name=$1 url=$2; shift 2
  echo "== $name"
  "$ROOT/.venv/bin/flexlb" bench --url "$url" --trace "$TRACE" --slice "$SLICE" --speed "$SPEED" \
    --max-output-tokens "$MAX_OUT" --slo-ttft-ms "$SLO_MS" --output "$OUT/$name" --no-progress \
    --timeout-s 300 --concurrency-limit 512 "$@" | tail -4
}

run_flexlb() {
  local specs=() i role f gw
  for ((i = 0; i < PREFILL + DECODE; i++)); do
    role=prefill; ((i >= PREFILL)) && role=decode
    f=$OUT/logs/worker-$i.out
    "$PY" -m app.cli worker --role $role --profile "$PROFILE" --log-level WARNING >"$f" 2>"$OUT/logs/worker-$i.err" &
    PIDS+=($!)
  done
  for ((i = 0; i < PREFILL + DECODE; i++)); do
    f=$OUT/logs/worker-$i.out
    wait_line "$f" worker_ready 120
    role=prefill; ((i >= PREFILL)) && role=decode
    specs+=("$role@$("$PY" -c 'import json,sys; print(json.loads(open(sys.argv[1]).readline())["address"])' "$f")")
  done
  gw=$(free_port)
  FLEXLB_ADMIN_TOKEN=$TOKEN FLEXLB_CLUSTER=compare-$$ "$PY" -m app.cli gateway --port "$gw" \
    --workers "$(IFS=,; echo "${specs[*]}")" --log-level WARNING >"$OUT/logs/gateway.log" 2>&1 &
  PIDS+=($!)
  local url=http://127.0.0.1:$gw i
  for ((i = 0; i < 300; i++)); do
    curl -sf "$url/readyz" >/dev/null 2>&1 && break; sleep 0.1
  done
  for s in $SYSTEMS; do
    case $s in
      flexlb-cost)
        curl -sf -X PUT "$url/admin/config" -H "Authorization: Bearer $TOKEN" -H 'content-type: application/json' \
          -d '{"prefill_strategy": "cost", "schedule_mode": "batch"}' >/dev/null
        bench flexlb-cost "$url" --admin-token "$TOKEN" ;;
      flexlb-rr)
        curl -sf -X PUT "$url/admin/config" -H "Authorization: Bearer $TOKEN" -H 'content-type: application/json' \
          -d '{"prefill_strategy": "round_robin", "schedule_mode": "batch"}' >/dev/null
        sleep 1  # the config change reaches the replica by pub/sub
        bench flexlb-rr "$url" --admin-token "$TOKEN" ;;
    esac
  done
  cleanup
}

start_facades() {  # sets FACADE_P (url bootstrap pairs), FACADE_D, STATUS
  FACADE_P=(); FACADE_D=(); STATUS=""
  local i port bport
  for ((i = 0; i < PREFILL + DECODE; i++)); do
    port=$(free_port)
    if ((i < PREFILL)); then
      bport=$(free_port)
      "$PY" -m workers.http_facade --role prefill --port "$port" --bootstrap-port "$bport" --profile "$PROFILE" \
        >"$OUT/logs/facade-$1-$i.log" 2>&1 &
      FACADE_P+=("http://127.0.0.1:$port $bport")
    else
      "$PY" -m workers.http_facade --role decode --port "$port" --profile "$PROFILE" >"$OUT/logs/facade-$1-$i.log" 2>&1 &
      FACADE_D+=("http://127.0.0.1:$port")
    fi
    PIDS+=($!)
    STATUS+="http://127.0.0.1:$port,"
  done
  for ((i = 0; i < PREFILL + DECODE; i++)); do wait_line "$OUT/logs/facade-$1-$i.log" facade_ready 60; done
}

run_peer() {  # run_peer sglang|vllm
  local kind=$1 port args=() p
  start_facades "$kind"
  port=$(free_port)
  for p in "${FACADE_P[@]}"; do
    if [ "$kind" = sglang ]; then read -r u b <<<"$p"; args+=(--prefill "$u" "$b"); else args+=(--prefill "${p%% *}"); fi
  done
  for p in "${FACADE_D[@]}"; do args+=(--decode "$p"); done
  # shellcheck disable=SC2086  # PEER_ARGS, SGLANG_ARGS and VLLM_ARGS are flag lists: split on purpose
  if [ "$kind" = sglang ]; then
    .venv-peers/bin/sglang-router launch --host 127.0.0.1 --port "$port" --pd-disaggregation "${args[@]}" \
      --policy cache_aware --max-concurrent-requests 4096 --queue-size 4096 --request-timeout-secs 600 \
      --log-level warn $PEER_ARGS $SGLANG_ARGS >"$OUT/logs/sglang-router.log" 2>&1 &
  else
    .venv-peers/bin/vllm-router --host 127.0.0.1 --port "$port" --vllm-pd-disaggregation "${args[@]}" \
      --policy cache_aware --max-concurrent-requests 4096 --queue-size 4096 --request-timeout-secs 600 \
      --log-level warning $PEER_ARGS $VLLM_ARGS >"$OUT/logs/vllm-router.log" 2>&1 &
  fi
  PIDS+=($!)
  wait_http "http://127.0.0.1:$port/v1/models" 60 || wait_http "http://127.0.0.1:$port/health" 30
  bench "$kind-router" "http://127.0.0.1:$port" --api completions --peer-name "$kind-router:cache_aware" \
    --facade-status "${STATUS%,}"
  cleanup
}

case " $SYSTEMS " in *" flexlb-"*) run_flexlb ;; esac
case " $SYSTEMS " in *" sglang "*) run_peer sglang ;; esac
case " $SYSTEMS " in *" vllm "*) run_peer vllm ;; esac

"$PY" - "$OUT" <<'PYEOF'
import json, sys
from pathlib import Path
from app.report import markdown_table
out = Path(sys.argv[1])
policies, metas = {}, {}
for d in sorted(p.parent for p in out.glob("*/results.json")):
    doc = json.loads((d / "results.json").read_text())
    for name, m in doc["policies"].items():
        label = {"flexlb-cost": "FlexLB cost+batch", "flexlb-rr": "FlexLB round_robin+batch"}.get(d.name, name)
        policies[label] = m
        metas[label] = doc["meta"]
any_meta = next(iter(metas.values()))
lines = [
    "# Router comparison",
    "",
    f"- trace: {any_meta['trace']} slice {any_meta['slice']}, speed {any_meta['speed']}, "
    f"{any_meta['requests']} requests; {'; '.join(n for n in any_meta['notes'] if 'INVALID' not in n)}",
    f"- machine: {any_meta['machine']}; date: {any_meta['date']}",
    "",
    markdown_table(policies),
    "",
    "| system | valid | engine lag mean ms | client send lag p99 ms |",
    "|---|---|---:|---:|",
]
for k, m in metas.items():
    lines.append(f"| {k} | {m['valid']} | {policies[k].get('engine_lag_mean_ms', 0):.1f} | "
                 f"{m.get('client_send_lag_p99_ms') or 0:.1f} |")
(out / "comparison.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
PYEOF
echo "comparison: $OUT/comparison.md"
