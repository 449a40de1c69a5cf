"""Benchmark formats: SWE-bench grading on the harness's log formats, SWE-bench 5.x records,
Terminal-Bench 1 / Harbor task directories (well-formed and malformed), and their episodes on the
local sandbox. Every record, log and task directory is written here (no benchmark content)."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest

from megathunder.rollout.tasks.datasets import DatasetError, SweTask, load_swe_bench, load_swe_smith, swe_smith_setup
from megathunder.rollout.sandbox import SandboxError
from megathunder.rollout.tasks.grading import GradingError, eval_script, grade
from megathunder.rollout.tasks.swe_local import SweLocalTask
from megathunder.rollout.tasks.task import tool_call_text
from megathunder.rollout.tasks.terminal_bench import TerminalBenchTask, harbor_reward, load_task_dirs
from tests.rollout_helpers import needs_root, run_scripted

START, END = ">>>>> Start Test Output", ">>>>> End Test Output"


def _log(body: str, exit_code: int) -> str:
    """A log as the eval script's bash -x run writes it (the markers' trace lines included)."""
    return (f"+ git apply -v -\nChecking patch t.py...\n+ echo '{START}'\n{START}\n{body}\n"
            f"+ SWEBENCH_TEST_EXIT_CODE={exit_code}\n+ echo '{END}'\n{END}\n>>>>> Test Exit Code: {exit_code}\n")


PYTEST_RA = """\
============================= test session starts ==============================
collected 4 items

pkg/tests/test_a.py ..F.s                                                  [100%]
=========================== short test summary info ============================
PASSED pkg/tests/test_a.py::test_keep
PASSED pkg/tests/test_a.py::test_fix[1-2]
FAILED pkg/tests/test_a.py::test_fix[3-4] - AssertionError: assert 5 == 4
PASSED pkg/tests/test_a.py::test_other
SKIPPED [1] pkg/tests/test_a.py:40: needs a GPU
==================== 1 failed, 3 passed, 1 skipped in 0.12s ===================="""

DJANGO = """\
Testing against Django installed in '/testbed/django'
Creating test database for alias 'default'...
test_fix (queries.tests.Lookups.test_fix) ... ok
test_keep (queries.tests.Lookups.test_keep) ... ok
test_broken (queries.tests.Lookups.test_broken) ... FAIL
test_crash (queries.tests.Lookups.test_crash) ... ERROR
test_later (queries.tests.Lookups.test_later) ... skipped 'no backend'

======================================================================
FAIL: test_broken (queries.tests.Lookups.test_broken)
----------------------------------------------------------------------
Ran 5 tests in 0.01s

FAILED (failures=1, errors=1, skipped=1)"""

SYMPY = """\
============================= test process starts ==============================
executable:         /usr/bin/python3  (3.11.0-final-0) [CPython]

sympy/core/tests/test_basic.py[3]
test_fix ok
test_keep ok
test_broken F

________________________________________________________________________________
_________________ sympy/core/tests/test_basic.py:test_broken __________________
AssertionError
============= tests finished: 2 passed, 1 failed, in 0.05 seconds =============="""


@pytest.mark.parametrize(("log", "parser", "fix", "keep", "broken"), [
    (PYTEST_RA, "parse_log_pytest", "pkg/tests/test_a.py::test_fix[1-2]", "pkg/tests/test_a.py::test_keep",
     "pkg/tests/test_a.py::test_fix[3-4]"),
    (DJANGO, "parse_log_django", "test_fix (queries.tests.Lookups.test_fix)",
     "test_keep (queries.tests.Lookups.test_keep)", "test_broken (queries.tests.Lookups.test_broken)"),
    (SYMPY, "parse_log_sympy", "test_fix", "test_keep", "test_broken"),
])  # fmt: skip
def test_fail_to_pass_and_pass_to_pass_on_the_harness_log_formats(log, parser, fix, keep, broken):
    ok = grade(_log(log, 1), [fix], [keep], log_parser=parser)
    assert ok.reward == 1.0 and ok.tests == {fix: "PASSED", keep: "PASSED"}
    assert json.loads(ok.detail)["resolution"] == "RESOLVED_FULL"
    # a FAIL_TO_PASS test that still fails: not resolved (partial when another one passes)
    partial = grade(_log(log, 1), [fix, broken], [keep], log_parser=parser)
    assert partial.reward == 0.0 and partial.tests[broken] == "FAILED"
    assert json.loads(partial.detail)["resolution"] == "RESOLVED_PARTIAL"
    # a PASS_TO_PASS test that now fails, or is missing from the log: a regression
    for p2p, status in ((broken, "FAILED"), ("never_ran_test", "MISSING")):
        reg = grade(_log(log, 1), [fix], [keep, p2p], log_parser=parser)
        assert reg.reward == 0.0 and reg.tests[p2p] == status


def test_harness_edge_cases():
    passing = "PASSED t.py::test_a\nPASSED t.py::test_b"
    assert grade(_log(passing, 0), ["t.py::test_a"], ["t.py::test_b"]).reward == 1.0
    # a log claiming every test passed while the command exited 1 is not the run that happened
    forged = grade(_log(passing, 1), ["t.py::test_a"], ["t.py::test_b"])
    assert forged.reward == 0.0 and json.loads(forged.detail)["log_valid"] is False
    # the test patch did not apply (the agent broke the test files): unresolved, not an error
    assert grade(">>>>> Patch Apply Failed\n" + _log(passing, 0), ["t.py::test_a"], []).reward == 0.0
    # a skipped FAIL_TO_PASS test is no fix; a skipped PASS_TO_PASS test is no regression
    skipped = "SKIPPED t.py::test_a\nPASSED t.py::test_b"
    assert grade(_log(skipped, 0), ["t.py::test_a"], []).reward == 0.0
    assert grade(_log("PASSED t.py::test_b\nSKIPPED t.py::test_a", 0), ["t.py::test_b"], ["t.py::test_a"]).reward == 1.0
    with pytest.raises(GradingError, match="never reached the test command"):
        grade("bash: pytest: command not found\n", ["t.py::test_a"], [])
    with pytest.raises(GradingError, match="unknown log_parser 'parse_log_nope'"):
        grade(_log(passing, 0), ["t.py::test_a"], [], log_parser="parse_log_nope")
    script = eval_script("pytest -rA t.py", "diff --git a/t.py b/t.py\n", reset_files=["t.py"], reset_to="abc123")
    assert script.index("git checkout -q abc123 -- t.py") < script.index("git apply") < script.index(START)
    assert script.index("SWEBENCH_TEST_EXIT_CODE=$?") < script.index(END) < script.index(">>>>> Test Exit Code")


def test_swe_bench_5_record_with_its_own_eval_script(tmp_path):
    rec = {"instance_id": "owner__proj-1", "repo": "owner/proj", "base_commit": "0" * 40,
           "problem_statement": "x is wrong", "FAIL_TO_PASS": '["test_x (proj.tests.T.test_x)"]', "PASS_TO_PASS": "[]",
           "log_parser": "parse_log_django", "eval_type": "pass_and_fail",
           "eval_script": f"#!/bin/bash\nset -uxo pipefail\ncd /testbed\necho '{START}'\n./runtests.py -v 2\necho '{END}'\n"}  # fmt: skip
    path = tmp_path / "v.jsonl"
    path.write_text(json.dumps(rec) + "\n" + json.dumps({**rec, "eval_type": "sometimes"}) + "\n")
    with pytest.raises(DatasetError, match=r"v.jsonl:2: field 'eval_type' must be pass_and_fail or fail_only"):
        load_swe_bench(path)
    path.write_text(json.dumps(rec) + "\n")
    (inst,) = load_swe_bench(path)
    script = inst.metadata["eval_script"]
    assert script.startswith("#!/bin/bash\nset -uxo pipefail\ncd /testbed\n") and "./runtests.py -v 2" in script
    assert script.index("SWEBENCH_TEST_EXIT_CODE=$?") < script.index(END)  # as the harness runs it
    assert inst.metadata["log_parser"] == "parse_log_django" and inst.metadata["setup"] == []


# --- Terminal-Bench 1 and Harbor task directories -------------------------------------------------

TB1_RUN_TESTS = 'set -e\ntest "$(cat greeting.txt)" = "$(cat "$TEST_DIR/expected.txt")"\n'
HARBOR_TEST_SH = ('if [ "$(cat greeting.txt)" = "$(cat /tests/expected.txt)" ]; then echo 1 > /logs/verifier/reward.txt; '
                  'else echo 0 > /logs/verifier/reward.txt; fi\n')  # fmt: skip


def _tb1(root, name, **over):
    d = root / name
    (d / "tests").mkdir(parents=True)
    (d / "task.yaml").write_text(over.get("yaml", "instruction: |\n  Write hello into greeting.txt.\n"
                                                  "max_test_timeout_sec: 20\n"))
    (d / "Dockerfile").write_text("FROM megathunder/base\nWORKDIR /app\nCOPY seed.txt /app/\n")
    (d / "seed.txt").write_text("seed\n")
    (d / "run-tests.sh").write_text(TB1_RUN_TESTS)
    (d / "tests" / "expected.txt").write_text("hello\n")
    (d / "solution.sh").write_text("echo hello > greeting.txt\n")
    return d


def _harbor(root, name, **over):
    d = root / name
    for sub in ("environment", "tests", "solution"):
        (d / sub).mkdir(parents=True)
    (d / "task.toml").write_text(over.get("toml", 'version = "1.0"\n[metadata]\ndifficulty = "easy"\n'
                                                  "[verifier]\ntimeout_sec = 30.0\n[agent]\ntimeout_sec = 60.0\n"))
    (d / "instruction.md").write_text("# Greeting\nWrite hi into greeting.txt.\n")
    (d / "environment" / "Dockerfile").write_text("FROM megathunder/base\nWORKDIR /app\nCOPY data.txt /app/\n")
    (d / "environment" / "data.txt").write_text("data\n")
    (d / "tests" / "test.sh").write_text(HARBOR_TEST_SH)
    (d / "tests" / "expected.txt").write_text("hi\n")
    (d / "solution" / "solve.sh").write_text("echo hi > greeting.txt\n")
    return d


def test_task_directories_load_both_formats(tmp_path):
    tb1, harbor = _tb1(tmp_path, "hello-tb1"), _harbor(tmp_path, "hello-harbor")
    (insts, skipped) = load_task_dirs(tmp_path)
    assert skipped == [] and [i.instance_id for i in insts] == ["hello-harbor", "hello-tb1"]
    h, t = insts
    assert h.prompt.startswith("# Greeting") and t.prompt == "Write hello into greeting.txt.\n"
    assert h.image == "megathunder-tb/hello-harbor:latest" and h.build is not None
    assert h.build.dockerfile == str(harbor / "environment" / "Dockerfile") and h.build.context == str(harbor / "environment")
    assert t.build is not None and t.build.dockerfile == str(tb1 / "Dockerfile")
    # the environment's files for the local sandbox; tests and solutions never among them
    assert set(h.files) == {"data.txt"} and set(t.files) == {"seed.txt"}
    assert set(t.metadata["tests"]) == {"run-tests.sh", "tests/expected.txt"} and t.metadata["test_timeout_s"] == 20
    assert set(h.metadata["tests"]) == {"tests/test.sh", "tests/expected.txt"} and h.metadata["test_timeout_s"] == 30
    # a prebuilt image named in task.toml replaces the built one's name
    (harbor / "task.toml").write_text('[environment]\ndocker_image = "registry.local/hello:1"\n')
    (h2,), _ = load_task_dirs(harbor)
    assert h2.image == "registry.local/hello:1"


@pytest.mark.parametrize(("make", "message"), [
    (lambda r: _tb1(r, "bad", yaml="instruction: [unclosed\n"), "bad/task.yaml: not valid YAML"),
    (lambda r: _tb1(r, "bad", yaml="instruction: 3\n"), "bad/task.yaml: field 'instruction' must be a non-empty string"),
    (lambda r: _tb1(r, "bad", yaml="instruction: x\nmax_test_timeout_sec: soon\n"),
     "bad/task.yaml: field 'max_test_timeout_sec' must be a positive number"),
    (lambda r: (_tb1(r, "bad") / "run-tests.sh").unlink(), "bad/run-tests.sh: missing"),
    (lambda r: (_tb1(r, "bad") / "Dockerfile").unlink(), "bad: no Dockerfile or docker-compose.yaml"),
    (lambda r: _harbor(r, "bad", toml="[verifier\n"), "bad/task.toml: not valid TOML"),
    (lambda r: _harbor(r, "bad", toml='verifier = "fast"\n'), "bad/task.toml: field 'verifier' must be a table"),
    (lambda r: _harbor(r, "bad", toml="[verifier]\ntimeout_sec = -1\n"),
     "bad/task.toml: field 'verifier.timeout_sec' must be a positive number"),
    (lambda r: (_harbor(r, "bad") / "instruction.md").unlink(), "bad/instruction.md: missing"),
    (lambda r: (_harbor(r, "bad") / "tests" / "test.sh").unlink(), "bad/tests/test.sh: missing"),
    (lambda r: (r / "bad").mkdir(), "bad: no task.yaml (Terminal-Bench 1) or task.toml (Harbor)"),
])  # fmt: skip
def test_malformed_task_directories_are_skipped_with_the_file_and_field(tmp_path, make, message, caplog):
    _tb1(tmp_path, "good-1")
    _harbor(tmp_path, "good-2")
    make(tmp_path)
    insts, skipped = load_task_dirs(tmp_path)
    assert [i.instance_id for i in insts] == ["good-1", "good-2"]
    assert len(skipped) == 1 and message in skipped[0] and str(tmp_path) in skipped[0]
    with caplog.at_level(logging.WARNING):
        task = TerminalBenchTask(str(tmp_path))
    assert len(task.instances(2)) == 2 and "skipped 1 malformed task" in caplog.text and message in caplog.text
    only_bad = tmp_path / "only"
    only_bad.mkdir()
    (tmp_path / "bad").rename(only_bad / "bad")
    with pytest.raises(DatasetError, match="no valid task") as err:
        TerminalBenchTask(str(only_bad))
    assert message in str(err.value)


def test_harbor_reward_files():
    assert harbor_reward("1\n", None) == 1.0 and harbor_reward(None, '{"reward": 0.25}') == 0.25
    for txt, js, match in ((None, None, "wrote no reward file"), ("yes", None, "not a number"),
                           (None, "{", "not JSON"), (None, '{"score": 1}', "no numeric 'reward'")):
        with pytest.raises(GradingError, match=match):
            harbor_reward(txt, js)


@needs_root
def test_terminal_bench_episodes_on_the_local_sandbox(tmp_path):
    tasks = tmp_path / "tasks"
    _tb1(tasks, "hello-tb1")
    _harbor(tasks, "hello-harbor")
    task = TerminalBenchTask(str(tasks))
    insts = task.instances(2)
    episodes, _ = run_scripted(task, insts, tmp_path)
    assert [ep.reward.reward for ep in episodes] == [1.0, 1.0]
    # the tests are not in the sandbox during the episode; the environment's files are
    look = tool_call_text("bash", command="ls -a; ls .megathunder tests 2>&1 | head -3")
    episodes, _ = run_scripted(task, insts, tmp_path, scripts={i.prompt: [look, "Done."] for i in insts})
    for inst, ep in zip(insts, episodes, strict=True):
        seen = ep.turns[0].tool_runs[0].observation
        assert next(iter(inst.files)) in seen and "expected.txt" not in seen and "No such file" in seen
        assert ep.reward.reward == 0.0 and ep.reward.status == "ok"
    # a Harbor test script that writes no reward file: the verifier failure policy
    (tasks / "hello-harbor" / "tests" / "test.sh").write_text("true\n")
    task = TerminalBenchTask(str(tasks))
    (ep, _), _ = run_scripted(task, task.instances(2), tmp_path)
    assert ep.reward.status == "error" and "no reward file" in ep.reward.detail and ep.reward.reward == 0.0


@needs_root
def test_swe_test_timeout_gets_the_failure_policy(tmp_path):
    task = SweLocalTask()
    inst = task.instances(1, seed=2)[0]
    slow = dataclasses.replace(inst, metadata={**inst.metadata, "test_timeout_s": 0.5,
                                                "eval_script": f"echo '{START}'\nsleep 5\n"})
    (ep,), _ = run_scripted(task, [slow], tmp_path, scripts={slow.prompt: ["Done."]},
                            verifier={"on_failure": "drop_group"})
    assert ep.reward.status == "timeout" and ep.reward.drop_group and "exceeded 0.5 s" in ep.reward.detail


@needs_root
def test_swe_smith_instance_is_set_up_on_the_buggy_repository(tmp_path):
    """SWE-smith: the instance's branch in the image's repository is checked out; without the
    branch, the record's bug ``patch`` is applied; with neither, set-up fails (a sandbox failure).
    The image's repository is made by set-up commands here (the local sandbox has no image)."""
    good = "def double(x):\n    return 2 * x\n"
    bug = ("diff --git a/mod.py b/mod.py\n--- a/mod.py\n+++ b/mod.py\n@@ -1,2 +1,2 @@\n def double(x):\n"
           "-    return 2 * x\n+    return x + x + 1\n")  # fmt: skip
    test = "import unittest\nfrom mod import double\n\n\nclass T(unittest.TestCase):\n    def test_double(self):\n        self.assertEqual(double(4), 8)\n"
    rec = {"instance_id": "toy__mod.abc123", "repo": "toy/mod", "image_name": "toy/mod:1", "patch": bug,
           "problem_statement": "double(4) returns 9", "FAIL_TO_PASS": ["test_double (test_mod.T.test_double)"],
           "PASS_TO_PASS": [], "test_command": "python3 -m unittest -v test_mod", "log_parser": "parse_log_django"}  # fmt: skip
    path = tmp_path / "smith.jsonl"
    path.write_text(json.dumps(rec) + "\n")
    task = SweTask("swe_smith", load_swe_smith(path))
    (inst,) = task.instances(1)
    git = "git -c user.name=t -c user.email=t@t"
    image_repo = [f"git init -q -b main && git add -A && {git} commit -qm base"]
    with_branch = [*image_repo, f"git checkout -q -b toy__mod.abc123 && git apply .bug.patch && {git} commit -qam bug "
                   "&& git checkout -q main"]  # fmt: skip
    look = tool_call_text("bash", command="git branch --show-current; cat mod.py")
    fix = tool_call_text("str_replace", path="mod.py", old="x + x + 1", new="2 * x")
    for prepare, branch in ((with_branch, "toy__mod.abc123"), (image_repo, "main")):
        made = dataclasses.replace(inst, files={"mod.py": good, "test_mod.py": test, ".bug.patch": bug},
                                   metadata={**inst.metadata, "setup": prepare + list(inst.metadata["setup"])})
        (ep,), _ = run_scripted(task, [made], tmp_path, scripts={made.prompt: [look, "I give up."]})
        seen = ep.turns[0].tool_runs[0].observation
        assert seen.startswith(branch) and "x + x + 1" in seen  # the agent works on the bug
        assert ep.reward.reward == 0.0 and ep.reward.tests == {rec["FAIL_TO_PASS"][0]: "FAILED"}
        (ep,), _ = run_scripted(task, [made], tmp_path, scripts={made.prompt: [fix, "Fixed."]})
        assert ep.reward.reward == 1.0
    no_patch = dataclasses.replace(inst, files={"mod.py": good, "test_mod.py": test},
                                   metadata={**inst.metadata, "setup": image_repo + swe_smith_setup(rec["instance_id"], "")})
    with pytest.raises(SandboxError, match="no branch toy__mod.abc123 in the repository, and the record has no patch"):
        run_scripted(task, [no_patch], tmp_path, scripts={no_patch.prompt: ["Done."]})
