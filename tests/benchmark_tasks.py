"""SWE-style instances and Terminal-Bench / Harbor tasks written for the tests and the benchmark
(none is a benchmark's): ``swe_instance`` makes a classic SWE-bench record and the build context of
an image laid out as the official ones are (the repository at base_commit in /testbed, a ``testbed``
environment behind ``/opt/miniconda3/bin/activate``: a stand-in for conda, which cannot be fetched
here; pytest copied from this machine). Run as a script, it writes everything ``megathunder bench
tasks`` measures, with images built from the local base image:

    python -m tests.benchmark_tasks OUT   # OUT/tasks (Terminal-Bench 1 + Harbor), OUT/swe_bench.jsonl (+ images)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t",
           "GIT_AUTHOR_DATE": "2025-01-01T00:00:00+0000", "GIT_COMMITTER_DATE": "2025-01-01T00:00:00+0000",
           "GIT_CONFIG_GLOBAL": "/dev/null", "GIT_CONFIG_NOSYSTEM": "1"}  # fmt: skip

ACTIVATE = """\
# A stand-in for Miniconda's activate (conda itself cannot be fetched here): `conda activate NAME`
# puts the environment /opt/miniconda3/envs/NAME first, as in the SWE-bench images.
conda() {
  if [ "$1" = activate ]; then
    export CONDA_DEFAULT_ENV="$2" PATH="/opt/miniconda3/envs/$2/bin:$PATH"
    export PYTHONPATH="/opt/miniconda3/envs/$2/lib/python3.11/site-packages"
  fi
}
"""
RUNTESTS = """\
#!/usr/bin/env python
# Django's test runner's interface (labels, --verbosity, --settings, --parallel) over unittest
import argparse, os, sys, unittest
p = argparse.ArgumentParser()
p.add_argument("labels", nargs="*")
p.add_argument("--verbosity", type=int, default=1)
p.add_argument("--settings")
p.add_argument("--parallel")
args = p.parse_args()
here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [here, os.path.dirname(here)]
suite = unittest.defaultTestLoader.loadTestsFromNames(args.labels)
sys.exit(not unittest.TextTestRunner(verbosity=args.verbosity).run(suite).wasSuccessful())
"""
COMPUTE = "def compute(x):\n    \"\"\"The identity, slowly.\"\"\"\n    return x + 1\n"
FIXED = COMPUTE.replace("return x + 1", "return x")

SWE_REPOS = {  # repo -> (version, source file, test file, its tests before the test patch, after it, F2P, P2P)
    "django/django": (
        "4.0", "django/utils/text.py", "tests/utils_tests/test_text.py",
        "import unittest\n\nfrom django.utils.text import compute\n\n\nclass FixtureTests(unittest.TestCase):\n"
        "    def test_fixture_old(self):\n        self.assertTrue(callable(compute))\n",
        "\n    def test_fixture_new(self):\n        self.assertEqual(compute(1), 1)\n",
        ["test_fixture_new (utils_tests.test_text.FixtureTests.test_fixture_new)"],
        ["test_fixture_old (utils_tests.test_text.FixtureTests.test_fixture_old)"]),
    "pallets/flask": (
        "2.3", "src/flask/helpers.py", "tests/test_helpers.py",
        "from flask.helpers import compute\n\n\ndef test_fixture_old():\n    assert callable(compute)\n",
        "\n\ndef test_fixture_new():\n    assert compute(1) == 1\n",
        ["tests/test_helpers.py::test_fixture_new"], ["tests/test_helpers.py::test_fixture_old"]),
}
EXTRA = {"django/django": {"django/__init__.py": "", "django/utils/__init__.py": "", "tests/runtests.py": RUNTESTS,
                           "tests/utils_tests/__init__.py": ""},
         "pallets/flask": {"src/flask/__init__.py": "",
                           "conftest.py": "import os, sys\n\nsys.path.insert(0, os.path.join(os.path.dirname(__file__), 'src'))\n"}}


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, env={**os.environ, **GIT_ENV}, check=True, capture_output=True,
                          text=True, timeout=60).stdout


def swe_instance(root: Path, repo: str, number: int) -> tuple[dict, Path]:
    """A classic record and its image's build context (the repository at base_commit in /testbed)."""
    version, source, test_file, tests, new_test, f2p, p2p = SWE_REPOS[repo]
    ctx = root / repo.replace("/", "__")
    testbed = ctx / "testbed"
    for rel, text in {**EXTRA[repo], source: COMPUTE, test_file: tests}.items():
        (testbed / rel).parent.mkdir(parents=True, exist_ok=True)
        (testbed / rel).write_text(text)
    if repo == "django/django":
        (testbed / "tests" / "runtests.py").chmod(0o755)
    git(testbed, "init", "-q")
    git(testbed, "add", "-A")
    git(testbed, "commit", "-qm", "base")
    base = git(testbed, "rev-parse", "HEAD").strip()
    (testbed / test_file).write_text(tests + new_test)
    test_patch = git(testbed, "diff")
    git(testbed, "checkout", "-q", "--", test_file)
    (testbed / source).write_text(FIXED)
    patch = git(testbed, "diff")
    git(testbed, "checkout", "-q", "--", source)
    env = ctx / "miniconda3"
    (env / "bin").mkdir(parents=True)
    (env / "bin" / "activate").write_text(ACTIVATE)
    site = env / "envs" / "testbed" / "lib" / "python3.11" / "site-packages"
    (env / "envs" / "testbed" / "bin").mkdir(parents=True)
    pytest_sh = env / "envs" / "testbed" / "bin" / "pytest"
    pytest_sh.write_text('#!/bin/sh\nexec python -m pytest "$@"\n')
    pytest_sh.chmod(0o755)
    import iniconfig, packaging, pluggy, pygments  # noqa: E401 -- the testbed's pytest, from this machine's

    for mod in (pytest, pluggy, iniconfig, packaging, pygments):
        shutil.copytree(Path(mod.__file__).parent, site / mod.__name__, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(Path(pytest.__file__).parent.parent / "_pytest", site / "_pytest",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(Path(pytest.__file__).parent.parent / "py.py", site / "py.py")  # pytest's own `py` shim
    (ctx / "Dockerfile").write_text(
        f"FROM {{base}}\nCOPY miniconda3 /opt/miniconda3\nCOPY testbed /testbed\n"
        "RUN ln -s /usr/bin/python3 /opt/miniconda3/envs/testbed/bin/python\nWORKDIR /testbed\n")
    owner, name = repo.split("/")
    record = {"repo": repo, "instance_id": f"{owner}__{name}-{number}", "base_commit": base, "patch": patch,
              "test_patch": test_patch, "problem_statement": f"compute(x) returns x + 1 instead of x ({source}).",
              "hints_text": "", "created_at": "2025-01-01T00:00:00Z", "version": version,
              "FAIL_TO_PASS": json.dumps(f2p), "PASS_TO_PASS": json.dumps(p2p), "environment_setup_commit": base}
    return record, ctx




def write_all(out: Path) -> dict:
    """The task set and the SWE-style instances (converted by the harness, images built)."""
    from megathunder.rollout.sandbox import images
    from megathunder.rollout.tasks.datasets import read_records
    from megathunder.rollout.tasks.swe_harness import convert_records
    from tests.task_sets import checked_set

    base = f"{images.BASE_REPOSITORY}:{images.base_image_key()}"
    if not images.image_exists(base):
        raise SystemExit(f"no base image {base}: run `megathunder sandbox build-base` first")
    checked_set(out / "tasks", base=base)
    made = [swe_instance(out / "swe", repo, 90101 + k) for k, repo in enumerate(SWE_REPOS)]
    (out / "classic.jsonl").write_text("".join(json.dumps(r) + "\n" for r, _ in made))
    converted = convert_records(read_records(out / "classic.jsonl"))
    (out / "swe_bench.jsonl").write_text("".join(json.dumps(r) + "\n" for r in converted))
    for rec, (_, ctx) in zip(converted, made, strict=True):
        dockerfile = ctx / "Dockerfile"
        dockerfile.write_text(dockerfile.read_text().replace("{base}", base))
        images.build_from_directory(rec["image"], str(dockerfile), str(ctx))
    return {"tasks": str(out / "tasks"), "swe_bench": str(out / "swe_bench.jsonl"),
            "images": [r["image"] for r in converted]}


if __name__ == "__main__":
    print(json.dumps(write_all(Path(sys.argv[1]))))
