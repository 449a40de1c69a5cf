#!/usr/bin/env bash
# Every GPU check in one call: one GPU, at most eight minutes, one JSON summary ($OUT/gpu_check.json).
#
#   bash tools/gpu_check.sh            on a GPU machine (the lent H100: carry [".whl"], below)
#   bash tools/gpu_check.sh --dry-run  anywhere, in seconds: the plan, the carried wheels, and that every
#                                      megathunder name the tests import resolves (CI runs it)
#
# The plan and the summary are tools/gpu_check.py's. A lent device machine (Python 3.12, a CUDA torch,
# transformers; no megatron-core, pydantic, Transformer Engine or vLLM; no network) needs the wheels of
# tools/gpu_check_wheels.txt carried: here, once,
#   echo /.whl/ >> .git/info/exclude
#   grep -v '^#' tools/gpu_check_wheels.txt | xargs python3 -m pip download --no-deps --only-binary=:all: \
#       --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
#       --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl
# then run this script with carry [".whl"]; it installs them into /tmp/site.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"  # the interpreter (CI passes its own)
if [ "${1:-}" = "--dry-run" ]; then
  bash -n "$0" || { echo "gpu_check --dry-run: $0 does not parse" >&2; exit 1; }
  PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec "$PYTHON" tools/gpu_check.py --dry-run
fi
if compgen -G ".whl/*.whl" > /dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH="/tmp/site:$PWD"
else
  export PYTHONPATH="$PWD"
fi
export PYTHONUNBUFFERED=1 TORCHDYNAMO_DISABLE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
exec "$PYTHON" tools/gpu_check.py --out "${OUT:-gpu_check_out}"
