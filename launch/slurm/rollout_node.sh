#!/bin/bash
# One rollout node: MT_SERVERS_PER_NODE vLLM servers (`megathunder serve`), MT_ROLLOUT_TP devices
# each, ports MT_SERVER_PORT + i, bound to this node's address ($1). Run by the launch scripts as
# one srun task per rollout node. If any server exits, the others are stopped (by PID) and this
# task exits with that server's status, so the launch script sees the failure at once.
#   rollout_node.sh ADDR LOG_DIR CONFIG [overrides...]
set -uo pipefail
addr=$1 log_dir=$2 config=$3
shift 3
node=${SLURMD_NODENAME:-$(hostname -s)}
pids=()
stop_servers() { for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null; done; }
trap 'stop_servers; wait; exit 143' TERM INT  # each server finishes its shutdown (bounded by the launch)
for ((i = 0; i < MT_SERVERS_PER_NODE; i++)); do
  port=$((MT_SERVER_PORT + i))
  if [[ "${MT_GPUS_PER_NODE:-0}" -gt 0 ]]; then  # server i: GPUs i*TP .. i*TP+TP-1
    first=$((i * MT_ROLLOUT_TP))
    export CUDA_VISIBLE_DEVICES=$(seq -s, "$first" $((first + MT_ROLLOUT_TP - 1)))
  fi
  tp_args=()
  [[ "$MT_ROLLOUT_TP" -gt 1 ]] && tp_args=(--tensor-parallel "$MT_ROLLOUT_TP")
  model_args=()
  [[ -n "${MT_ROLLOUT_MODEL:-}" ]] && model_args=(--model "$MT_ROLLOUT_MODEL")
  echo "${MT_POOL:-rollout} node $node: server $i on $addr:$port (log $log_dir/${MT_POOL:-rollout}-$node-$port.log)"
  $MT_PYTHON -m megathunder.cli serve "$config" "$@" --host "$addr" --port "$port" "${tp_args[@]}" \
    "${model_args[@]}" >"$log_dir/${MT_POOL:-rollout}-$node-$port.log" 2>&1 &
  pids+=($!)
done
wait -n "${pids[@]}"
status=$?
echo "${MT_POOL:-rollout} node $node: a vLLM server exited with status $status; stopping the others" >&2
tail -n 20 "$log_dir/${MT_POOL:-rollout}-$node"-*.log >&2
stop_servers
wait
exit $(( status == 0 ? 1 : status ))
