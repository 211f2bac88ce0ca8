#!/usr/bin/env bash
# The README's "Run it for real" fleet as real processes on whatever ports are
# free: N kvsim engines, one kvbridge each, and kvrouter (embedded NATS,
# in-memory index, kv_aware with shadow comparison). Nothing listens beyond
# 127.0.0.1; everything stops on Ctrl-C.
#
#   scripts/fleet.sh [-n INSTANCES] [-p FIRST_PORT] [-d DIR] [-e ENGINE]
#
# ENGINE is whose KV-event format the engines speak: vllm (default), sglang or
# trtllm (kvsim --engine, kvbridge --format; docs/engines.md).
# The ports are taken from FIRST_PORT (default 18000) upward, skipping any in
# use; the script prints them, the config it wrote and a request to send.
set -euo pipefail
cd "$(dirname "$0")/.."

n=4 first=18000 dir="" engine=vllm
while getopts "n:p:d:e:h" o; do
  case $o in
    n) n=$OPTARG ;;
    e) engine=$OPTARG ;;
    p) first=$OPTARG ;;
    d) dir=$OPTARG ;;
    *) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
  esac
done
[[ $n =~ ^[0-9]+$ && $n -ge 1 && $n -le 64 ]] || { echo "fleet.sh: -n wants 1..64 instances" >&2; exit 2; }
[[ $first =~ ^[0-9]+$ && $first -ge 1024 && $first -le 60000 ]] || { echo "fleet.sh: -p wants a port in 1024..60000" >&2; exit 2; }
case $engine in
  vllm | sglang) format=$engine ;;
  trtllm) format=trtllm-json ;;
  *) echo "fleet.sh: -e wants vllm, sglang or trtllm" >&2; exit 2 ;;
esac

# in_use PORT: something accepts connections on 127.0.0.1:PORT.
in_use() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
# take K: the first K consecutive free ports at or after $next.
next=$first
take() {
  local k=$1 p
  while :; do
    for ((p = next; p < next + k; p++)); do
      if in_use "$p"; then next=$((p + 1)); continue 2; fi
    done
    taken=$next; next=$((next + k)); return
  done
}
take "$n"; http=$taken
take "$n"; zmq=$taken
take "$n"; replay=$taken
take "$n"; bridge=$taken
take 3; listen=$taken; admin=$((taken + 1)); nats=$((taken + 2))

[ -n "$dir" ] || dir=$(mktemp -d "${TMPDIR:-/tmp}/kvrouter-fleet.XXXXXX")
mkdir -p "$dir"
make --no-print-directory build >/dev/null

model=meta-llama/Llama-3.1-70B-Instruct
{
  cat <<EOF
# written by scripts/fleet.sh; see examples/router-kv.yaml for the commented form
listen: 127.0.0.1:$listen
admin_listen: 127.0.0.1:$admin
log: {level: info, format: text}
index: {backend: memory}
events:
  nats: {embedded: true, listen: 127.0.0.1:$nats, store_dir: $dir/nats}
pools:
  - name: llama
    model: $model
    tokenizer: {source: simple}
    invoke_path: /v1/completions
    invoke_stream_path: /v1/completions
    routing: {strategy: kv_aware, prefix_length: 8192, concurrency_threshold: 64, shadow: true}
    health: {path: /health, interval: 5s}
    allowed_instance_urls: [127.0.0.1]   # heartbeat discovery: loopback engines only
    instances:
EOF
  for ((i = 0; i < n; i++)); do
    echo "      - {id: vllm-$i, url: http://127.0.0.1:$((http + i))}"
  done
} >"$dir/router.yaml"

pids=()
stop() { [ ${#pids[@]} -eq 0 ] || kill "${pids[@]}" 2>/dev/null; wait 2>/dev/null; }
trap stop EXIT
trap 'exit 130' INT TERM

bin/kvsim --instances "$n" --port "$http" --zmq-port "$zmq" --replay-port "$replay" --engine "$engine" >"$dir/kvsim.log" 2>&1 &
pids+=($!)
bin/kvrouter --config "$dir/router.yaml" >"$dir/kvrouter.log" 2>&1 &
pids+=($!)
for ((i = 0; i < n; i++)); do
  bin/kvbridge --pool llama --instance "vllm-$i" --model "$model" \
    --nats-url "nats://127.0.0.1:$nats" --engine-url "http://127.0.0.1:$((http + i))" \
    --zmq-endpoint "tcp://127.0.0.1:$((zmq + i))" --replay-endpoint "tcp://127.0.0.1:$((replay + i))" \
    --format "$format" --first-seq 1 --listen "127.0.0.1:$((bridge + i))" >"$dir/kvbridge-$i.log" 2>&1 &
  pids+=($!)
done

# Ready when the router answers /readyz; a process that died says why.
for ((t = 0; t < 300; t++)); do
  for p in "${pids[@]}"; do
    kill -0 "$p" 2>/dev/null || { echo "fleet.sh: a process exited; logs in $dir:" >&2; tail -n 5 "$dir"/*.log >&2; exit 1; }
  done
  curl -fsS "http://127.0.0.1:$listen/readyz" >/dev/null 2>&1 && break
  sleep 0.1
done
curl -fsS "http://127.0.0.1:$listen/readyz" >/dev/null || { echo "fleet.sh: kvrouter not ready after 30 s; logs in $dir" >&2; exit 1; }

cat <<EOF
kvrouter fleet up ($n kvsim engines speaking $engine's events, $n kvbridges, embedded NATS)
  data plane   http://127.0.0.1:$listen
  admin        http://127.0.0.1:$admin   (/dashboard, /metrics, /admin/pools/llama/compare)
  NATS         nats://127.0.0.1:$nats
  engines      http://127.0.0.1:$http..$((http + n - 1))
  config, logs $dir
kvctl:  export KVROUTER_ADMIN_URL=http://127.0.0.1:$admin
Try:
  curl -s -D - -o /dev/null http://127.0.0.1:$listen/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{"model":"$model","messages":[{"role":"user","content":"hello"}],"max_tokens":8}'
Ctrl-C stops everything.
EOF
wait
