"""``tools/gpu_check.sh``: its dry run passes here (CI runs it: the GPU check is ready whenever a GPU
is), and the dry run's checks catch what they are for -- an import a GPU-less run never executes
going stale, a test pytest's ``-m gpu`` would drop, a wheel list that drifts, steps over budget."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "tools" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module
    spec.loader.exec_module(module)
    return module


def test_the_dry_run_passes():
    import os

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the script finds the repository itself
    proc = subprocess.run(["bash", "tools/gpu_check.sh", "--dry-run"], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**env, "PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ok" in proc.stdout.splitlines()[-1]


def test_a_stale_function_level_import_is_caught(tmp_path):
    gc = _gpu_check()
    test = tmp_path / "test_x_gpu.py"
    test.write_text(
        "import pytest\n"
        "from megathunder.learner import hf, parallel\n"  # submodules of a package
        "from megathunder.config import LearnerConfig\n"  # a re-export
        "from tests.gpu_helpers import record\n"
        "@pytest.mark.gpu\n"
        "def test_a():\n"
        "    from megathunder.rollout.engines.transfer import Bucket, FrameWriter\n"  # Bucket: gone
        "    from megathunder.weights.nowhere import thing\n"
        "    import megathunder.learner.nothing\n"
        "    wire = pytest.importorskip('megathunder.weights.wire')\n"
        "def test_b():\n"
        "    pass\n")
    missing, optional = gc.stale_imports(test)
    assert missing == ["from megathunder.rollout.engines.transfer import Bucket",
                       "from megathunder.weights.nowhere (no such module)", "import megathunder.learner.nothing"]
    assert optional == ["megathunder.weights.wire"]
    assert gc.unmarked_tests(test) == ["test_b"]


def test_the_wheel_list_must_be_pinned_and_tested_here(tmp_path):
    gc = _gpu_check()
    wheels = tmp_path / "wheels.txt"
    wheels.write_text("# carried\nmegatron-core==0.0.1\npydantic>=2\npydantic==2.0\npydantic==2.0\n")
    problems = gc.wheel_problems(wheels)
    assert any("megatron-core==0.0.1, but this machine tests" in p for p in problems)
    assert any("'pydantic>=2' is not name==version" in p for p in problems)
    assert any("pydantic twice" in p for p in problems)
    wheels.write_text("einops==0.0\n")
    assert any("megatron-core is not carried" in p for p in gc.wheel_problems(wheels))
    assert gc.wheel_problems() == []  # the shipped list


def test_the_plan_fits_eight_minutes_and_every_gpu_test_is_run_or_excused():
    gc = _gpu_check()
    assert sum(s.budget_s for s in gc.STEPS) <= gc.BUDGET_S == 480
    run = {t for s in gc.STEPS for t in s.tests}
    assert not run & set(gc.NOT_RUN)
    on_disk = {str(p.relative_to(REPO)) for p in (REPO / "tests" / "gpu").glob("test_*.py")}
    assert on_disk == run | set(gc.NOT_RUN)


def test_pytest_reports_are_counted_with_every_skip_reason(tmp_path):
    gc = _gpu_check()
    report = tmp_path / "r.xml"
    report.write_text(
        '<testsuites><testsuite>'
        '<testcase classname="tests.gpu.a" name="test_ok" file="a.py"/>'
        '<testcase classname="tests.gpu.a" name="test_skip" file="a.py"><skipped message="needs two CUDA GPUs"/></testcase>'
        '<testcase classname="tests.gpu.a" name="test_bad" file="a.py"><failure message="assert 1 == 2"/></testcase>'
        '<testcase classname="tests.gpu.a" name="test_err" file="a.py"><error message="boom"/></testcase>'
        '</testsuite></testsuites>')
    counts = gc.junit_counts(report)
    assert (counts["passed"], counts["failed"], counts["skipped"]) == (1, 2, 1)
    assert counts["skips"] == {"a.py::test_skip": "needs two CUDA GPUs"}
    assert gc.last_json_line('noise\n{"bench": "learner", "mfu_sync": 0.41}\n') == {"bench": "learner", "mfu_sync": 0.41}
