#!/usr/bin/env bash
# One prefill and one decode vLLM instance with PDConnector, driven by hand with curl:
# the two-leg flow a PD proxy performs (docs/guides/connector.md, "The request flow").
#   bash examples/1p1d_by_hand.sh [MODEL_DIR] [push|pull]
set -euo pipefail
MODEL=${1:-$(python3 -c 'from vllm_pd.small_model import ensure_default_model; print(ensure_default_model())')}
MODE=${2:-push}
P_PORT=8100; D_PORT=8200; P_KV=14600; D_KV=14700
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1
serve() {  # port core role kv_port
  VLLM_CPU_OMP_THREADS_BIND=$2 python3 -m vllm.entrypoints.openai.api_server --model "$MODEL" \
    --port "$1" --served-model-name small --max-model-len 2048 --kv-cache-memory-bytes 256m --enforce-eager \
    --kv-transfer-config "{\"kv_connector\":\"PDConnector\",\"kv_role\":\"$3\",\"kv_port\":$4,
      \"kv_load_failure_policy\":\"recompute\",\"kv_connector_extra_config\":{\"transport\":\"tcp\",\"host\":\"127.0.0.1\"}}" \
    > "/tmp/vllm-pd-example-$1.log" 2>&1 &
}
serve $P_PORT 0 kv_producer $P_KV; P=$!
serve $D_PORT 1 kv_consumer $D_KV; D=$!
trap 'kill $P $D 2>/dev/null; wait 2>/dev/null' EXIT
for port in $P_PORT $D_PORT; do
  until curl -sf "127.0.0.1:$port/health" >/dev/null; do sleep 2; echo -n .; done
done
echo " both up"
BODY='{"model":"small","prompt":"the prefill instance computes the prompt and the decode instance","max_tokens":16,"temperature":0}'
PARAMS='{"do_remote_decode":true}'
[ "$MODE" = push ] && PARAMS="{\"do_remote_decode\":true,\"transfer_mode\":\"push\",\"decode_endpoint\":\"tcp://127.0.0.1:$D_KV\"}"
# leg 1: prefill computes the prompt (and, in push mode, writes its KV to decode layer by layer)
KV=$(curl -s 127.0.0.1:$P_PORT/v1/completions -H 'Content-Type: application/json' \
  -d "$(python3 -c "import json,sys; b=json.loads(sys.argv[1]); b.update(max_tokens=1, stream=False, kv_transfer_params=json.loads(sys.argv[2])); print(json.dumps(b))" "$BODY" "$PARAMS")" \
  | python3 -c 'import json,sys; print(json.dumps(json.load(sys.stdin)["kv_transfer_params"]))')
echo "prefill returned kv_transfer_params: $KV"
# leg 2: decode generates from the transferred KV
curl -s 127.0.0.1:$D_PORT/v1/completions -H 'Content-Type: application/json' \
  -d "$(python3 -c "import json,sys; b=json.loads(sys.argv[1]); b['kv_transfer_params']=json.loads(sys.argv[2]); print(json.dumps(b))" "$BODY" "$KV")"
echo
