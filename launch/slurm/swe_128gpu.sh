#!/bin/bash
# GRPO on SWE-style tasks on 16 nodes x 8 GPUs (launch/slurm/swe_128gpu.yaml): rollout nodes run a
# vLLM server and, beside it, a sandbox server (`megathunder sandbox serve`: every episode's
# container, its tool calls and its test run); learner nodes run the Megatron learner with the
# controller on learner rank 0, attached to both kinds of servers over HTTP. No container runs on a
# learner node.
#
#   sbatch launch/slurm/swe_128gpu.sh                       # from the repository root
#   MT_OVERRIDES="learner.model.hf_checkpoint=/models/qwen2.5-32b task.path=/data/swe.jsonl" \
#     sbatch launch/slurm/swe_128gpu.sh
#   MT_SANDBOX_NODES=4 sbatch --nodes=20 launch/slurm/swe_128gpu.sh   # sandboxes on 4 dedicated CPU nodes
#   MT_DRY_RUN=1 MT_NODELIST='gpu[01-16]' bash launch/slurm/swe_128gpu.sh   # print the plan only
#
# Environment: as launch/slurm/grpo_128gpu.sh, and
#   MT_SANDBOX_NODES  0: a sandbox server on each rollout node; N: on the job's last N nodes instead
#                     (CPU nodes; MT_LEARNER_NODES is then the nodes less rollout and sandbox ones)
#   MT_SANDBOX_PORT   8300; MT_SANDBOX_API_KEY the servers' secret (default: a fresh one per job)
#   MT_SANDBOX_RESERVED_CPUS / MT_SANDBOX_RESERVED_MEMORY_GB  what vLLM's host processes keep of a
#                     rollout node (16 / 256; 0 on dedicated nodes); MT_SANDBOX_NODE_MEMORY_GB: a
#                     sandbox node's memory (default MT_HOST_MEMORY_GB)
# Sequence: config check -> plan (learner memory, and the sandbox servers' CPUs and memory per node)
# -> rollout servers and sandbox servers start -> learner preflight -> every server's /health ->
# training, with the servers' URLs passed to the trainer. The sandbox servers stop (every sandbox
# destroyed) at exit, on a failure and before a requeue.
#
#SBATCH --job-name=mt-swe
#SBATCH --nodes=16
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=12
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=mt-swe-%j.out
set -uo pipefail
cd "${MT_REPO:-${SLURM_SUBMIT_DIR:-.}}" || exit 1
source launch/slurm/lib.sh
MT_CONFIG=${MT_CONFIG:-launch/slurm/swe_128gpu.yaml}

mt_settings
mt_sandbox_settings
mt_network_env
mt_plan
mt_check_config
mt_check_plan
mt_start_rollout
mt_start_sandboxes
mt_learner_preflight
mt_wait_healthy
trap 'mt_stop_rollout' EXIT  # the servers (vLLM and sandbox) stop however the script ends
mt_train rollout.engine.deployment=server "$(mt_urls_override rollout.engine.server_urls)" \
  "$(mt_urls_override sandbox.server_urls sandbox)"
