#!/bin/bash
# On-policy distillation on 16 nodes x 8 GPUs: the student samples on rollout nodes (vLLM
# servers) and trains on learner nodes (Megatron TP x DP, controller on rank 0), where the frozen
# teacher (MT_TEACHER_MODEL, any size, the student's tokenizer) runs in the student's layout and
# scores each finished turn on its K/V cache (objective.kind: opd; launch/slurm/opd_128gpu.yaml).
#
#   MT_TEACHER_MODEL=/models/Qwen2.5-32B-Instruct \
#   MT_OVERRIDES="learner.model.hf_checkpoint=/models/Qwen2.5-7B-Instruct" sbatch launch/slurm/opd_128gpu.sh
#   MT_DRY_RUN=1 MT_NODELIST='gpu[01-16]' MT_TEACHER_MODEL=/m bash launch/slurm/opd_128gpu.sh
#
# The teacher scores on the learner ranks, beside the student; there is no remote teacher pool
# (the trainer has no client for one), so MT_TEACHER_NODES is refused rather than started for nothing.
#
# Environment: as grpo_128gpu.sh, plus MT_TEACHER_MODEL (required, HF directory).
# Default split: 4 rollout + 12 learner nodes.
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
MT_CONFIG=${MT_CONFIG:-launch/slurm/opd_128gpu.yaml}
MT_TEACHER_MODEL=${MT_TEACHER_MODEL:?set MT_TEACHER_MODEL to the teacher HF directory}
[[ -z "${MT_TEACHER_NODES:-}" ]] || mt_die launch \
  "MT_TEACHER_NODES=$MT_TEACHER_NODES: the teacher runs on the learner ranks; there is no teacher server pool"

mt_settings
mt_network_env
mt_plan
mt_check_config
mt_check_plan "objective.teacher.hf_checkpoint=$MT_TEACHER_MODEL"
mt_start_rollout
mt_learner_preflight
mt_wait_healthy
mt_train rollout.engine.deployment=server "$(mt_urls_override rollout.engine.server_urls)" \
  "objective.teacher.hf_checkpoint=$MT_TEACHER_MODEL"
