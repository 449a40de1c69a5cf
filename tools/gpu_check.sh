#!/usr/bin/env bash
# Every GPU check in one go, sized to finish in about 10 minutes on one H200.
#
# On a lent device machine (Python 3.12, CUDA torch, no megatron-core/TE/vLLM), carry the
# wheels of what it lacks: here, once,
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#       -d .whl megatron-core==0.16.1 einops pydantic pydantic-core annotated-types typing-inspection pyyaml tqdm
# and run this script with carry [".whl"]. It installs them into /tmp/site if present.
#
# Prints the GPU tests' results, `megathunder bench memory --device cuda` (the memory plan against
# max allocated CUDA memory; tests/gpu/test_memory_plan_gpu.py asserts the same run within 15%) and
# `megathunder bench learner` figures (bf16, local spec; TE and FP8 when Transformer Engine is
# importable); writes them under $OUT (or ./gpu_check_out).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_check_out}"
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:$PWD"
else
  export PYTHONPATH="$PWD"
fi
export PYTHONUNBUFFERED=1 TORCHDYNAMO_DISABLE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, megatron.core; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'mcore', megatron.core.__version__)" | tee -a "$OUT/gpu.txt"

status=0
timeout 240 python3 -m pytest tests/gpu -m gpu -q -p no:cacheprovider --ignore=tests/gpu/test_weight_transfer_gpu.py \
    --ignore=tests/gpu/test_memory_plan_gpu.py \
    2>&1 | tee "$OUT/gpu_tests.txt" || status=1
# weights over NCCL (the gloo path's code, backend switched): one GPU per rank, so it needs 2
timeout 120 python3 -m pytest tests/gpu/test_weight_transfer_gpu.py -m gpu -q -rs -p no:cacheprovider 2>&1 \
    | tee "$OUT/weight_transfer_gpu.txt" || status=1
# megathunder plan vs CUDA's max allocated memory, one layout per process (bf16; TE when installed)
timeout 600 python3 -m megathunder.cli bench memory --device cuda 2>&1 | grep -v -i warn \
    | tee "$OUT/memory.txt" || status=1
for spec in local transformer_engine; do
  if [ "$spec" = transformer_engine ] && ! python3 -c "import transformer_engine" 2>/dev/null; then
    echo "transformer_engine not installed: TE and FP8 benchmarks skipped" | tee -a "$OUT/bench.txt"
    continue
  fi
  timeout 150 python3 -m megathunder.cli bench learner --dtype bfloat16 --layer-spec "$spec" \
      --hidden-size 2048 --num-layers 8 --num-heads 16 --vocab-size 32768 --seq-len 2048 \
      --num-groups 4 --group-size 4 --repeats 3 2>&1 | grep -v -i warn | tee -a "$OUT/bench.txt" || status=1
done
exit $status
