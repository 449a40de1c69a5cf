#!/bin/bash
# On-policy distillation on 16 nodes x 8 GPUs: the student samples on rollout nodes (vLLM
# servers), a teacher scores the student's tokens on teacher nodes (vLLM servers of the teacher
# model), and the student trains on learner nodes (Megatron TP x PP x DP, controller on rank 0).
#
#   MT_TEACHER_MODEL=/models/Qwen2.5-72B-Instruct \
#   MT_OVERRIDES="learner.model.hf_checkpoint=/models/Qwen2.5-7B-Instruct" sbatch launch/slurm/opd_128gpu.sh
#   MT_DRY_RUN=1 MT_NODELIST='gpu[01-16]' MT_TEACHER_MODEL=/m bash launch/slurm/opd_128gpu.sh
#
# Status: main has no OPD trainer yet (the OPD streaming core lives on the opd branch), so this
# script has the GRPO trainer's structure plus the teacher pool: teacher servers start, are
# health-checked with the others, and their URLs reach the trainer as MT_TEACHER_URLS (env) and,
# once the OPD config has the field, as the override MT_TEACHER_URLS_KEY=[...] (e.g.
# teacher.server_urls). Until then the job trains GRPO with the teacher pool up.
#
# Environment: as grpo_128gpu.sh, plus
#   MT_TEACHER_NODES 2 (taken after the rollout nodes); MT_TEACHER_MODEL (required, HF directory)
#   MT_TEACHER_PORT  8200; MT_TEACHER_URLS_KEY (unset: env only)
# Default split: 4 rollout + 2 teacher + 10 learner nodes.
#
#SBATCH --job-name=mt-opd
#SBATCH --nodes=16
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=12
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=mt-opd-%j.out
set -uo pipefail
cd "${MT_REPO:-${SLURM_SUBMIT_DIR:-.}}" || exit 1
source launch/slurm/lib.sh
MT_CONFIG=${MT_CONFIG:-launch/slurm/grpo_128gpu.yaml}
export MT_TEACHER_NODES=${MT_TEACHER_NODES:-2}
MT_TEACHER_PORT=${MT_TEACHER_PORT:-8200}
MT_TEACHER_MODEL=${MT_TEACHER_MODEL:?set MT_TEACHER_MODEL to the teacher HF directory}

mt_settings
mt_network_env
mt_plan
mt_check_config
mt_start_rollout
mt_start_servers teacher MT_TEACHER_HOSTS "$MT_TEACHER_PORT" "$MT_TEACHER_MODEL" "$MT_CONFIG" "${MT_OVERRIDE_ARGS[@]}"
mt_learner_preflight
mt_wait_healthy
teacher=()
[[ -n "${MT_TEACHER_URLS_KEY:-}" ]] && teacher=("$(mt_urls_override "$MT_TEACHER_URLS_KEY" teacher)")
export MT_TEACHER_URLS="${MT_POOL_URLS[teacher]:-}"
mt_train rollout.engine.deployment=server "$(mt_urls_override rollout.engine.server_urls)" "${teacher[@]}"
