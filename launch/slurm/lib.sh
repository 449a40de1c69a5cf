# Shared by the launch scripts (sourced): settings from the environment, node split, the memory
# plan (megathunder plan: MT_GPU_MEMORY_GB, default 80; MT_HOST_MEMORY_GB, default the learner
# node's), rollout servers, sandbox servers (agentic configs: `megathunder sandbox serve` on the
# rollout nodes or on MT_SANDBOX_NODES dedicated CPU nodes), learner preflight, health checks, the
# learner step with checkpoint-and-requeue.
# Every failure goes through mt_die, which names the component and exits non-zero.

mt_log() { echo "megathunder launch [$(date -u +%H:%M:%S)]: $*"; }

mt_die() {  # COMPONENT MESSAGE: stop what we started, say which component failed, exit 1
  echo "megathunder launch: FAILED: $1: $2" >&2
  mt_stop_rollout
  exit 1
}

mt_settings() {
  MT_CONFIG=${MT_CONFIG:?set MT_CONFIG to the YAML config}
  read -r -a MT_OVERRIDE_ARGS <<<"${MT_OVERRIDES:-}"
  # the servers' shared secret: one per job (every step inherits it; never on a command line);
  # the servers need it for any endpoint but /health, the trainer sends it
  [[ -n "${MT_VLLM_API_KEY:-}" ]] || MT_VLLM_API_KEY=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')
  export MT_VLLM_API_KEY
  MT_OVERRIDE_ARGS+=(rollout.engine.api_key_env=MT_VLLM_API_KEY)
  read -r -a MT_SRUN_EXTRA <<<"${MT_SRUN_ARGS:-}"  # added to every srun, e.g. Pyxis' --container-image=...
  MT_PYTHON=${MT_PYTHON:-python}
  MT_GPUS_PER_NODE=${MT_GPUS_PER_NODE:-8}   # 0: CPU nodes (the local test cluster)
  # CPUs per step task, given to every srun: Slurm 22.05-23.02 steps do not inherit the job's
  # --cpus-per-task (each task would be bound to one CPU); a one-task-per-node step (a rollout
  # node's servers, the config and plan checks) gets the node's CPUs of the job
  MT_CPUS_PER_TASK=${MT_CPUS_PER_TASK:-${SLURM_CPUS_PER_TASK:-1}}
  MT_CPUS_PER_NODE=${MT_CPUS_PER_NODE:-${SLURM_CPUS_ON_NODE:-$MT_CPUS_PER_TASK}}
  MT_NODELIST=${MT_NODELIST:-${SLURM_JOB_NODELIST:?not in a Slurm job: set MT_NODELIST (and MT_DRY_RUN=1)}}
  if [[ "${MT_DRY_RUN:-0}" == 1 ]]; then  # outside Slurm: megathunder's own host-list expansion
    mapfile -t MT_NODES < <($MT_PYTHON -c 'import sys; from megathunder.learner.rendezvous import expand_hostlist
print("\n".join(expand_hostlist(sys.argv[1])))' "$MT_NODELIST")
  else  # the batch script runs on the host (the image, if any, is for the steps): Slurm's own
    mapfile -t MT_NODES < <(scontrol show hostnames "$MT_NODELIST")
  fi
  ((${#MT_NODES[@]} > 0)) || mt_die launch "cannot expand node list $MT_NODELIST"
  MT_ROLLOUT_NODES=${MT_ROLLOUT_NODES:-4}
  MT_SANDBOX_NODES=${MT_SANDBOX_NODES:-0}  # dedicated CPU nodes for sandbox servers: the job's last ones
  MT_LEARNER_NODES=${MT_LEARNER_NODES:-$((${#MT_NODES[@]} - MT_ROLLOUT_NODES - MT_SANDBOX_NODES))}
  if ((MT_GPUS_PER_NODE > 0)); then
    MT_ROLLOUT_TP=${MT_ROLLOUT_TP:-8}
    MT_SERVERS_PER_NODE=${MT_SERVERS_PER_NODE:-$((MT_GPUS_PER_NODE / MT_ROLLOUT_TP))}
    MT_LEARNER_TASKS_PER_NODE=${MT_LEARNER_TASKS_PER_NODE:-$MT_GPUS_PER_NODE}
  else
    MT_ROLLOUT_TP=${MT_ROLLOUT_TP:-1}
    MT_SERVERS_PER_NODE=${MT_SERVERS_PER_NODE:-1}
    MT_LEARNER_TASKS_PER_NODE=${MT_LEARNER_TASKS_PER_NODE:-1}
  fi
  MT_GPU_ARGS=()  # server and learner steps get their nodes' GPUs explicitly
  ((MT_GPUS_PER_NODE > 0)) && MT_GPU_ARGS=(--gpus-per-node="$MT_GPUS_PER_NODE")
  MT_SERVER_PORT=${MT_SERVER_PORT:-8100}
  MT_HEALTH_TIMEOUT_S=${MT_HEALTH_TIMEOUT_S:-900}
  MT_LOG_DIR=${MT_LOG_DIR:-logs/slurm/${SLURM_JOB_ID:-dry-run}}/attempt-${SLURM_RESTART_COUNT:-0}
  MT_DRY_RUN=${MT_DRY_RUN:-0}
  trap mt_on_usr1 USR1  # from here on: SIGUSR1's default action would end the batch script
  export MT_PYTHON MT_GPUS_PER_NODE MT_ROLLOUT_TP MT_SERVERS_PER_NODE MT_SERVER_PORT
  export PYTHONUNBUFFERED=1

  if ((MT_SANDBOX_NODES > 0)); then
    ((${#MT_NODES[@]} == MT_ROLLOUT_NODES + MT_LEARNER_NODES + MT_SANDBOX_NODES)) || mt_die launch \
      "the job has ${#MT_NODES[@]} nodes ($MT_NODELIST) but MT_ROLLOUT_NODES + MT_LEARNER_NODES + MT_SANDBOX_NODES = $MT_ROLLOUT_NODES + $MT_LEARNER_NODES + $MT_SANDBOX_NODES"
  else
    ((${#MT_NODES[@]} == MT_ROLLOUT_NODES + MT_LEARNER_NODES)) || mt_die launch \
      "the job has ${#MT_NODES[@]} nodes ($MT_NODELIST) but MT_ROLLOUT_NODES + MT_LEARNER_NODES = $MT_ROLLOUT_NODES + $MT_LEARNER_NODES"
  fi
  ((MT_LEARNER_NODES >= 1)) || mt_die launch "MT_LEARNER_NODES=$MT_LEARNER_NODES: the learner needs a node"
  ((MT_GPUS_PER_NODE == 0 || MT_SERVERS_PER_NODE * MT_ROLLOUT_TP <= MT_GPUS_PER_NODE)) || mt_die launch \
    "MT_SERVERS_PER_NODE x MT_ROLLOUT_TP = $MT_SERVERS_PER_NODE x $MT_ROLLOUT_TP > MT_GPUS_PER_NODE=$MT_GPUS_PER_NODE"
  MT_ROLLOUT_HOSTS=("${MT_NODES[@]:0:MT_ROLLOUT_NODES}")
  MT_LEARNER_HOSTS=("${MT_NODES[@]:MT_ROLLOUT_NODES:MT_LEARNER_NODES}")
  MT_SANDBOX_HOSTS=("${MT_NODES[@]:MT_ROLLOUT_NODES+MT_LEARNER_NODES}")  # empty: none dedicated
  MT_LEARNER_WORLD=$((MT_LEARNER_NODES * MT_LEARNER_TASKS_PER_NODE))
  MT_LEARNER_NODELIST=$(IFS=,; echo "${MT_LEARNER_HOSTS[*]}")
  mkdir -p "$MT_LOG_DIR"
  mt_weight_transfer
}

mt_weight_transfer() {  # weights stream from the learner's stages into every vLLM worker over collectives:
  # NCCL on GPU nodes, gloo on CPU ones, the rendezvous store served by the controller (learner rank 0,
  # on the first learner node) at MT_WEIGHT_PORT. Put first: a user's own weight_transfer overrides win.
  local addr backend
  addr=$(mt_node_addr "${MT_LEARNER_HOSTS[0]}")
  [[ -n "$addr" ]] || mt_die launch "no address for the first learner node ${MT_LEARNER_HOSTS[0]}"
  backend=gloo
  ((MT_GPUS_PER_NODE > 0)) && backend=nccl
  MT_WEIGHT_PORT=${MT_WEIGHT_PORT:-29600}
  MT_OVERRIDE_ARGS=(rollout.engine.weight_transfer.kind=collective rollout.engine.weight_transfer.backend="$backend"
                    rollout.engine.weight_transfer.host="$addr" rollout.engine.weight_transfer.port="$MT_WEIGHT_PORT"
                    "${MT_OVERRIDE_ARGS[@]}")
}

mt_network_env() {  # NCCL / InfiniBand defaults for GPU nodes; a site's own settings win
  ((MT_GPUS_PER_NODE > 0)) || return 0
  export NCCL_IB_DISABLE=${NCCL_IB_DISABLE:-0}
  export NCCL_IB_HCA=${NCCL_IB_HCA:-mlx5}            # InfiniBand HCAs (prefix match)
  export NCCL_IB_GID_INDEX=${NCCL_IB_GID_INDEX:-3}   # RoCE v2; ignored on native IB
  export NCCL_IB_TIMEOUT=${NCCL_IB_TIMEOUT:-22}
  export NCCL_IB_RETRY_CNT=${NCCL_IB_RETRY_CNT:-7}
  export NCCL_NET_GDR_LEVEL=${NCCL_NET_GDR_LEVEL:-PHB}  # GPUDirect RDMA when NIC and GPU share a switch
  export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-^lo,docker}  # bootstrap: any interface but these
  export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-${NCCL_SOCKET_IFNAME#^lo,docker}}
  [[ -n "$GLOO_SOCKET_IFNAME" ]] || unset GLOO_SOCKET_IFNAME  # the controller channel (gloo)
  export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
  export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}  # a dead peer fails the step
  export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}  # Megatron TP comm/compute ordering
}

mt_node_addr() {  # the address Slurm reaches NODE at (NodeAddr); the name itself in a dry run
  if [[ "$MT_DRY_RUN" == 1 ]]; then echo "$1"; return; fi
  scontrol show node -o "$1" | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2
}

mt_plan() {
  mt_log "job ${SLURM_JOB_ID:-dry-run} (attempt ${SLURM_RESTART_COUNT:-0}): ${#MT_NODES[@]} nodes ($MT_NODELIST), ${MT_GPUS_PER_NODE} GPUs each"
  if ((MT_ROLLOUT_NODES == 0)); then
    mt_log "rollout: no rollout nodes: the engine of the config (rollout.engine) runs with the controller on learner rank 0"
  else
    mt_log "rollout: ${MT_ROLLOUT_NODES} nodes (${MT_ROLLOUT_HOSTS[*]:-none}), ${MT_SERVERS_PER_NODE} vLLM servers per node, TP ${MT_ROLLOUT_TP} each"
  fi
  mt_log "learner: ${MT_LEARNER_NODES} nodes (${MT_LEARNER_HOSTS[*]}), ${MT_LEARNER_TASKS_PER_NODE} ranks per node, world ${MT_LEARNER_WORLD}; controller on learner rank 0 (${MT_LEARNER_HOSTS[0]})"
  mt_log "weights: streamed from each pipeline stage over collectives (${MT_OVERRIDE_ARGS[1]#*=}); rendezvous at ${MT_OVERRIDE_ARGS[2]#*=}:${MT_WEIGHT_PORT}"
  if ((${MT_SANDBOX_SERVERS:-0})); then
    mt_log "sandboxes: ${#MT_SANDBOX_SERVER_HOSTS[@]} sandbox servers, one per node ${MT_SANDBOX_WHERE} (${MT_SANDBOX_SERVER_HOSTS[*]}), port ${MT_SANDBOX_PORT}; episodes' containers run there, none on the learner nodes"
  fi
  mt_log "config: $MT_CONFIG ${MT_OVERRIDES:-}; logs: $MT_LOG_DIR"
}

MT_ATTACHED_ARGS=()  # set by mt_attached_args (mt_check_config)

mt_attached_args() {  # sets MT_ATTACHED_ARGS: the trainer's view of the rollout servers, for every
  # check before they start (config, plan, preflight): attached to their URLs, as mt_train will be
  MT_ATTACHED_ARGS=()
  ((MT_ROLLOUT_NODES > 0)) || return 0
  local node addr i urls=""
  for node in "${MT_ROLLOUT_HOSTS[@]}"; do
    addr=$(mt_node_addr "$node")
    for ((i = 0; i < MT_SERVERS_PER_NODE; i++)); do urls+="\"http://${addr:-$node}:$((MT_SERVER_PORT + i))\","; done
  done
  MT_ATTACHED_ARGS=(rollout.engine.deployment=server "rollout.engine.server_urls=[${urls%,}]")
}

mt_check_config() {  # a bad config is named before any server or rank starts (in the steps' environment)
  mt_attached_args
  local cmd=($MT_PYTHON -m megathunder.cli config "$MT_CONFIG" "${MT_OVERRIDE_ARGS[@]}" "${MT_ATTACHED_ARGS[@]}" "$@")
  [[ "$MT_DRY_RUN" == 1 ]] || cmd=(srun "${MT_SRUN_EXTRA[@]}" --nodes=1 --ntasks=1 --cpus-per-task="$MT_CPUS_PER_TASK"
                                    --nodelist="${MT_LEARNER_HOSTS[0]}" --job-name=config "${cmd[@]}")
  "${cmd[@]}" >"$MT_LOG_DIR/config.yaml" 2>"$MT_LOG_DIR/config.err" || mt_die config "$(grep -v Warning "$MT_LOG_DIR/config.err")"
}

mt_check_plan() {  # [overrides...]: the layout's memory fits the learner nodes, or the part that does not is named
  # (megathunder plan: model config.json on a learner node, before any server or rank starts)
  local cmd=($MT_PYTHON -m megathunder.cli plan "$MT_CONFIG" "${MT_OVERRIDE_ARGS[@]}" "${MT_ATTACHED_ARGS[@]}" "$@"
             --world "$MT_LEARNER_WORLD"
             --ranks-per-node "$MT_LEARNER_TASKS_PER_NODE")
  if ((MT_GPUS_PER_NODE > 0)); then cmd+=(--gpu-memory-gb "${MT_GPU_MEMORY_GB:-80}"); else cmd+=(--cpu); fi
  [[ -n "${MT_HOST_MEMORY_GB:-}" ]] && cmd+=(--host-memory-gb "$MT_HOST_MEMORY_GB")
  if ((${MT_SANDBOX_SERVERS:-0})); then  # the sandbox servers' CPUs and memory per node, beside vLLM's share
    cmd+=(--sandbox-nodes "${#MT_SANDBOX_SERVER_HOSTS[@]}" --sandbox-node-cpus "$MT_CPUS_PER_NODE"
          --sandbox-reserved-cpus "$MT_SANDBOX_RESERVED_CPUS" --sandbox-reserved-memory-gb "$MT_SANDBOX_RESERVED_MEMORY_GB")
    [[ -n "${MT_SANDBOX_NODE_MEMORY_GB:-}" ]] && cmd+=(--sandbox-node-memory-gb "$MT_SANDBOX_NODE_MEMORY_GB")
  fi
  [[ "$MT_DRY_RUN" == 1 ]] || cmd=(srun "${MT_SRUN_EXTRA[@]}" --nodes=1 --ntasks=1 --cpus-per-task="$MT_CPUS_PER_TASK"
                                    --nodelist="${MT_LEARNER_HOSTS[0]}" --job-name=plan "${cmd[@]}")
  local status=0
  "${cmd[@]}" >"$MT_LOG_DIR/plan.txt" 2>"$MT_LOG_DIR/plan.err" || status=$?
  if ((status == 2)) && [[ "$MT_DRY_RUN" == 1 ]]; then  # a dry run away from the models: nothing to read
    mt_log "plan: not checked in this dry run: $(grep -v Warning "$MT_LOG_DIR/plan.err" | tail -n 1)"
    return 0
  fi
  ((status == 0)) || mt_die plan "$(grep -v Warning "$MT_LOG_DIR/plan.err" | grep -v '^ *warnings.warn' | tail -n 5)"
  mt_log "plan: $(grep -E '^total ' "$MT_LOG_DIR/plan.txt" | head -1 | awk '{print $2" GiB per rank"}'); fits (${MT_LOG_DIR}/plan.txt)"
  if ((${MT_SANDBOX_SERVERS:-0})); then
    mt_log "plan: sandbox servers:$(grep -E '^  per node (CPUs|memory)' "$MT_LOG_DIR/plan.txt" | sed 's/^  per node/;/' | tr -d '\n' | tr -s ' ' | sed 's/^;//')"
  fi
}

# ---- vLLM server pools (rollout) -----------------------------------------------
MT_ROLLOUT_PIDS=()         # pid:node:pool of each node's srun task
declare -A MT_POOL_URLS=() # pool -> space-separated URLs

mt_start_servers() {  # POOL HOSTS_ARRAY PORT MODEL(empty: the config's) CONFIG [overrides...]
  local pool=$1
  local -n hosts=$2
  local port=$3 model=$4 config=$5 node addr i
  shift 5
  for node in "${hosts[@]}"; do
    addr=$(mt_node_addr "$node")
    [[ -n "$addr" ]] || mt_die "$pool" "no address for node $node"
    for ((i = 0; i < MT_SERVERS_PER_NODE; i++)); do
      MT_POOL_URLS[$pool]+="http://$addr:$((port + i)) "
    done
    local cmd=(srun "${MT_SRUN_EXTRA[@]}" "${MT_GPU_ARGS[@]}" --nodes=1 --ntasks=1 --cpus-per-task="$MT_CPUS_PER_NODE"
               --nodelist="$node" --kill-on-bad-exit=1 --job-name="$pool"
               --output="$MT_LOG_DIR/$pool-$node.out"
               env MT_SERVER_PORT="$port" MT_ROLLOUT_MODEL="$model" MT_POOL="$pool"
               bash launch/slurm/rollout_node.sh "$addr" "$MT_LOG_DIR" "$config" "$@")
    if [[ "$MT_DRY_RUN" == 1 ]]; then echo "would run: ${cmd[*]} &"; continue; fi
    "${cmd[@]}" &
    MT_ROLLOUT_PIDS+=("$!:$node:$pool")
  done
}

mt_start_rollout() {  # the policy's servers on the rollout nodes
  # each reads the config as a server of the run (rollout.engine.deployment=server: what the trainer's
  # server-side settings, e.g. chaos faults on servers, are checked against)
  mt_start_servers rollout MT_ROLLOUT_HOSTS "$MT_SERVER_PORT" "${MT_ROLLOUT_MODEL:-}" "$MT_CONFIG" "${MT_OVERRIDE_ARGS[@]}" \
    rollout.engine.deployment=server
}

mt_stop_rollout() {  # the servers stop cleanly (a sandbox server destroys every sandbox): SIGTERM to
  # their job steps' tasks (srun itself, signalled, SIGKILLs its step), then up to MT_STOP_TIMEOUT_S
  # for them to finish, then their sruns are signalled
  ((${#MT_ROLLOUT_PIDS[@]})) || return 0
  local entry step deadline=$((SECONDS + ${MT_STOP_TIMEOUT_S:-60}))
  if [[ -n "${SLURM_JOB_ID:-}" ]]; then
    for step in $(squeue --steps --jobs="$SLURM_JOB_ID" --noheader --format="%i %j" 2>/dev/null |
                  awk '$2 == "rollout" || $2 == "sandbox" {print $1}'); do
      scancel --signal=TERM "$step" 2>/dev/null || true
    done
  fi
  for entry in "${MT_ROLLOUT_PIDS[@]}"; do
    while kill -0 "${entry%%:*}" 2>/dev/null && ((SECONDS < deadline)); do sleep 1; done
    kill -TERM "${entry%%:*}" 2>/dev/null || true
  done
  MT_ROLLOUT_PIDS=()
}

mt_check_rollout_alive() {  # a server task that ended is a failure, named with its log's tail
  local entry pid node pool status
  for entry in "${MT_ROLLOUT_PIDS[@]}"; do
    IFS=: read -r pid node pool <<<"$entry"
    if ! kill -0 "$pid" 2>/dev/null; then
      wait "$pid"; status=$?
      mt_die "$pool server on $node" "exited with status $status $1; its log ($MT_LOG_DIR/$pool-$node.out):
$(tail -n 25 "$MT_LOG_DIR/$pool-$node.out" 2>/dev/null)"
    fi
  done
}

mt_wait_healthy() {  # every server of every pool answers /health with 200, or the component is named
  [[ "$MT_DRY_RUN" == 1 || ${#MT_POOL_URLS[@]} == 0 ]] && return 0
  local deadline=$((SECONDS + MT_HEALTH_TIMEOUT_S)) pool url pending
  while true; do
    mt_check_rollout_alive "before it was healthy"
    pending=()
    for pool in "${!MT_POOL_URLS[@]}"; do
      for url in ${MT_POOL_URLS[$pool]}; do
        curl -sf -m 2 -o /dev/null "$url/health" || pending+=("$pool:$url")
      done
    done
    ((${#pending[@]} == 0)) && break
    ((SECONDS < deadline)) || mt_die "${pending[0]%%:*}" "servers not healthy after ${MT_HEALTH_TIMEOUT_S} s: ${pending[*]}"
    sleep 2
  done
  for pool in "${!MT_POOL_URLS[@]}"; do
    local urls=(${MT_POOL_URLS[$pool]}) kind=vLLM
    [[ "$pool" == sandbox ]] && kind=sandbox
    mt_log "$pool healthy: ${#urls[@]} $kind servers answer /health (${urls[*]})"
  done
}

mt_urls_override() {  # KEY POOL -> KEY=["url",...]
  local joined
  joined=$(printf '"%s",' ${MT_POOL_URLS[${2:-rollout}]})
  echo "$1=[${joined%,}]"
}

# ---- sandbox servers (agentic configs: sandbox.backend remote) ------------------------------
mt_sandbox_settings() {  # call after mt_settings: where the sandbox servers run, their port and secret
  MT_SANDBOX_SERVERS=1
  MT_SANDBOX_PORT=${MT_SANDBOX_PORT:-8300}
  if ((MT_SANDBOX_NODES > 0)); then
    MT_SANDBOX_SERVER_HOSTS=("${MT_SANDBOX_HOSTS[@]}") MT_SANDBOX_WHERE="on dedicated CPU nodes"
    MT_SANDBOX_RESERVED_CPUS=${MT_SANDBOX_RESERVED_CPUS:-0} MT_SANDBOX_RESERVED_MEMORY_GB=${MT_SANDBOX_RESERVED_MEMORY_GB:-0}
  else  # beside vLLM: its host processes keep a share of the node
    ((MT_ROLLOUT_NODES > 0)) || mt_die launch "sandbox servers go on the rollout nodes or MT_SANDBOX_NODES; both are 0"
    MT_SANDBOX_SERVER_HOSTS=("${MT_ROLLOUT_HOSTS[@]}") MT_SANDBOX_WHERE="beside vLLM on the rollout nodes"
    MT_SANDBOX_RESERVED_CPUS=${MT_SANDBOX_RESERVED_CPUS:-16} MT_SANDBOX_RESERVED_MEMORY_GB=${MT_SANDBOX_RESERVED_MEMORY_GB:-256}
  fi
  # their shared secret: one per job, in the environment of every step (never on a command line)
  [[ -n "${MT_SANDBOX_API_KEY:-}" ]] || MT_SANDBOX_API_KEY=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')
  export MT_SANDBOX_API_KEY
  MT_OVERRIDE_ARGS+=(sandbox.api_key_env=MT_SANDBOX_API_KEY sandbox.port="$MT_SANDBOX_PORT")
}

mt_start_sandboxes() {  # one `megathunder sandbox serve` per sandbox node (a job step named sandbox:
  # `--overlap` shares a rollout node with its vLLM step); stopped with the rollout servers (SIGTERM:
  # every sandbox destroyed), at exit and before a requeue
  local node addr
  for node in "${MT_SANDBOX_SERVER_HOSTS[@]}"; do
    addr=$(mt_node_addr "$node")
    [[ -n "$addr" ]] || mt_die sandbox "no address for node $node"
    MT_POOL_URLS[sandbox]+="http://$addr:$MT_SANDBOX_PORT "
    local cmd=(srun "${MT_SRUN_EXTRA[@]}" --overlap --nodes=1 --ntasks=1 --cpus-per-task="$MT_CPUS_PER_NODE"
               --nodelist="$node" --kill-on-bad-exit=1 --job-name=sandbox --output="$MT_LOG_DIR/sandbox-$node.out"
               $MT_PYTHON -m megathunder.cli sandbox serve "$MT_CONFIG" "${MT_OVERRIDE_ARGS[@]}"
               --host "$addr" --port "$MT_SANDBOX_PORT")
    if [[ "$MT_DRY_RUN" == 1 ]]; then echo "would run: ${cmd[*]} &"; continue; fi
    "${cmd[@]}" &
    MT_ROLLOUT_PIDS+=("$!:$node:sandbox")
  done
}

# ---- learner -----------------------------------------------------------------------------------
mt_learner_srun() {  # NAME CMD...: one task per learner rank over the learner nodes
  local name=$1
  shift
  echo srun "${MT_SRUN_EXTRA[@]}" "${MT_GPU_ARGS[@]}" --nodes="$MT_LEARNER_NODES" --ntasks-per-node="$MT_LEARNER_TASKS_PER_NODE" \
    --cpus-per-task="$MT_CPUS_PER_TASK" --ntasks="$MT_LEARNER_WORLD" --nodelist="$MT_LEARNER_NODELIST" --kill-on-bad-exit=1 --label \
    --job-name="$name" --output="$MT_LOG_DIR/$name-%N.out" "$@"
}

mt_learner_preflight() {  # the ranks form the expected world (TP x PP x DP checked) in seconds
  local cmd
  read -r -a cmd <<<"$(mt_learner_srun preflight $MT_PYTHON -m megathunder.learner.preflight)"
  cmd+=("$MT_CONFIG" "${MT_OVERRIDE_ARGS[@]}" "${MT_ATTACHED_ARGS[@]}" --expect-world "$MT_LEARNER_WORLD")
  if [[ "$MT_DRY_RUN" == 1 ]]; then echo "would run: ${cmd[*]}"; return 0; fi
  "${cmd[@]}" || mt_die "learner" "preflight failed (ranks did not form a world of $MT_LEARNER_WORLD); its logs:
$(tail -n 25 "$MT_LOG_DIR"/preflight-*.out 2>/dev/null)"
  mt_log "learner healthy: $(grep -ho 'megathunder preflight: .*' "$MT_LOG_DIR"/preflight-*.out | head -1)"
}

MT_LEARNER_PID=
MT_GOT_USR1=0
MT_NUM_USR1=0
mt_on_usr1() {
  MT_GOT_USR1=1
  MT_NUM_USR1=$((MT_NUM_USR1 + 1))
  mt_log "SIGUSR1 (time limit or preemption near): asking the trainer to checkpoint after this step"
  [[ -n "$MT_LEARNER_PID" ]] && kill -USR1 "$MT_LEARNER_PID" 2>/dev/null
}

mt_train() {  # the learner step (controller on rank 0); checkpoint-and-requeue on SIGUSR1
  local cmd status
  read -r -a cmd <<<"$(mt_learner_srun learner $MT_PYTHON -m megathunder.cli train)"
  cmd+=("$MT_CONFIG" "${MT_OVERRIDE_ARGS[@]}" "$@")
  if [[ "$MT_DRY_RUN" == 1 ]]; then echo "would run: ${cmd[*]}"; return 0; fi
  if ((MT_GOT_USR1)); then  # the time limit is near before training started: nothing to save
    mt_stop_rollout
    mt_log "SIGUSR1 before training started; requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID" || mt_die "requeue" "scontrol requeue $SLURM_JOB_ID failed (submit with --requeue)"
    exit 0
  fi
  mt_log "training: ${cmd[*]}"
  # rank 0 writes its exit status here: srun's own can be a follower's 143 (killed by
  # --kill-on-bad-exit while exiting) after rank 0 stopped with 75
  export MEGATHUNDER_STATUS_FILE="$MT_LOG_DIR/learner.status"
  rm -f "$MEGATHUNDER_STATUS_FILE"
  "${cmd[@]}" &
  MT_LEARNER_PID=$!
  local traps waited
  while true; do  # a SIGUSR1 trap interrupts `wait` (status > 128): wait again for the real status
    traps=$MT_NUM_USR1
    wait "$MT_LEARNER_PID"; waited=$?
    ((waited == 127)) && break  # already collected: keep the status from before
    status=$waited
    ((MT_NUM_USR1 == traps)) && break
  done
  if ((status != 0)) && [[ "$(cat "$MEGATHUNDER_STATUS_FILE" 2>/dev/null)" == 75 ]]; then
    status=75  # rank 0 checkpointed and stopped; srun reported a follower killed while it exited
  fi
  if ((status == 75)); then  # the trainer checkpointed and stopped (SIGUSR1)
    mt_stop_rollout
    mt_log "the trainer saved a checkpoint and stopped; requeueing job $SLURM_JOB_ID (it resumes from checkpoints/latest)"
    scontrol requeue "$SLURM_JOB_ID" || mt_die "requeue" "scontrol requeue $SLURM_JOB_ID failed (submit with --requeue)"
    exit 0
  fi
  if ((status != 0)); then
    local dead=""
    for entry in "${MT_ROLLOUT_PIDS[@]}"; do kill -0 "${entry%%:*}" 2>/dev/null || dead+=" ${entry#*:}"; done
    [[ -n "$dead" ]] && mt_die "rollout server(s)${dead//:/ }" "died during training; the learner exited with status $status"
    mt_die "learner" "megathunder train exited with status $status; its logs:
$(tail -n 25 "$MT_LOG_DIR"/learner-*.out 2>/dev/null)"
  fi
  mt_stop_rollout
  mt_log "training finished; rank 0's summary:"
  grep -h '^0: {' "$MT_LOG_DIR"/learner-*.out | tail -1 || true
}
