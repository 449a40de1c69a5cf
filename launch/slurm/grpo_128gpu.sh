#!/bin/bash
# GRPO on 16 nodes x 8 GPUs: rollout nodes run vLLM servers, learner nodes run the Megatron learner
# (TP x PP x DP, one srun task per GPU, ranks from Slurm's environment; no torchrun) with the
# controller (agent loop, schedule) on learner rank 0, attached to the servers over HTTP.
#
#   sbatch launch/slurm/grpo_128gpu.sh                      # from the repository root
#   MT_OVERRIDES="learner.model.hf_checkpoint=/models/qwen2.5-32b" \
#     sbatch launch/slurm/grpo_128gpu.sh
#   MT_DRY_RUN=1 MT_NODELIST='gpu[01-16]' bash launch/slurm/grpo_128gpu.sh   # print the plan only
#
# Environment (defaults for 16 x 8 GPUs):
#   MT_CONFIG        megathunder YAML config (default launch/slurm/grpo_128gpu.yaml)
#   MT_OVERRIDES     space-separated key=value overrides
#   MT_ROLLOUT_NODES 4 (0: the config's engine runs on learner rank 0); MT_LEARNER_NODES: the rest. MT_GPUS_PER_NODE 8 (0: CPU nodes)
#   MT_ROLLOUT_TP    8 (GPUs per vLLM server); MT_SERVERS_PER_NODE GPUs / TP; MT_SERVER_PORT 8100
#   MT_LEARNER_TASKS_PER_NODE  GPUs per node (learner ranks per node)
#   MT_ROLLOUT_MODEL serve this HF directory instead of the config's policy model
#   MT_WEIGHT_PORT   29600: the weight-transfer rendezvous on the first learner node (weights stream from
#                    every pipeline stage into the vLLM workers: NCCL on GPU nodes, gloo on CPU nodes)
#   MT_HEALTH_TIMEOUT_S 900; MT_LOG_DIR logs/slurm/JOBID (per attempt: attempt-N/); MT_PYTHON python
# Sequence: config check -> rollout servers start -> learner preflight (world size, TP x PP x DP)
# -> every server's /health -> training. Any component that does not come up ends the job
# non-zero with "megathunder launch: FAILED: <component>: ...". SIGUSR1 (120 s before the time
# limit) makes the trainer checkpoint after its current step; the job is then requeued and resumes.
#
#SBATCH --job-name=mt-grpo
#SBATCH --nodes=16
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=12
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=mt-grpo-%j.out
set -uo pipefail
cd "${MT_REPO:-${SLURM_SUBMIT_DIR:-.}}" || exit 1
source launch/slurm/lib.sh
MT_CONFIG=${MT_CONFIG:-launch/slurm/grpo_128gpu.yaml}

mt_settings
mt_network_env
mt_plan
mt_check_config
mt_check_plan
mt_start_rollout
mt_learner_preflight
mt_wait_healthy
if ((MT_ROLLOUT_NODES > 0)); then
  mt_train rollout.engine.deployment=server "$(mt_urls_override rollout.engine.server_urls)"
else
  mt_train  # the config's engine (e.g. in_process) next to the controller
fi
