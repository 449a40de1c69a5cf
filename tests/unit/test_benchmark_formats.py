"""Benchmark formats: SWE-bench grading on the harness's log formats (and the infrastructure
failures it tells apart from failing tests), SWE-bench 5.x records, Terminal-Bench 1 / Harbor task
directories (well-formed and malformed, with their harness settings), and their episodes on the
local sandbox. Every record, log and task directory is written here (no benchmark content)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging

import pytest

from megathunder.config import LocalSandboxConfig
from megathunder.rollout.sandbox import LocalSandbox, SandboxError
from megathunder.rollout.tasks.datasets import (
    DatasetError,
    load_swe_bench,
    swe_smith_grade_script,
    swe_smith_setup,
)
from megathunder.rollout.tasks.grading import GradingError, grade
from megathunder.rollout.tasks.swe_local import SweLocalTask
from megathunder.rollout.tasks.task import tool_call_text
from megathunder.rollout.tasks.terminal_bench import (
    TerminalBenchTask,
    harbor_reward,
    load_task_dirs,
    tb1_pytest_results,
)
from tests.rollout_helpers import needs_root, run_scripted, sandbox_cfg

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
    with pytest.raises(GradingError, match="unknown log_parser 'parse_log_nope'"):
        grade(_log(passing, 0), ["t.py::test_a"], [], log_parser="parse_log_nope")


def test_infrastructure_failures_are_errors_not_failing_tests():
    """A run that never reached its tests, a test runner that was not found (bash's 127) or could
    not run (126), and an unresolved log with one of the harness's environment signatures are
    infrastructure failures (GradingError: an InfrastructureError), never reward 0; a failing
    test, a patch that did not apply and an out-of-memory kill (which a patch can cause) are 0."""
    from megathunder.rollout.verifiers import InfrastructureError

    assert issubclass(GradingError, InfrastructureError)
    with pytest.raises(GradingError, match="never reached the test command"):
        grade("bash: pytest: command not found\n", ["t.py::test_a"], [])
    for code, why in ((127, "was not found"), (126, "could not be executed")):
        with pytest.raises(GradingError, match=f"the test command {why} \\(exit {code}\\)"):
            grade(_log("bash: line 9: pytest: command not found", code), ["t.py::test_a"], [])
    dns = _log("FAILED t.py::test_a - ConnectionError: Could not resolve host: pypi.org", 1)
    with pytest.raises(GradingError, match="the test environment failed \\(network_unreachable\\)"):
        grade(dns, ["t.py::test_a"], [])
    assert grade(_log("FAILED t.py::test_a - assert 1 == 2", 1), ["t.py::test_a"], []).reward == 0.0
    assert grade(_log("FAILED t.py::test_a\nKilled", 137), ["t.py::test_a"], []).reward == 0.0  # OOM: the tests'
    # the same signature in a resolved log is not a failure at all
    assert grade(_log("PASSED t.py::test_a\nCould not resolve host: x", 0), ["t.py::test_a"], []).reward == 1.0


def test_swe_bench_5_record_with_its_own_eval_script(tmp_path):
    rec = {"instance_id": "owner__proj-1", "repo": "owner/proj", "base_commit": "0" * 40, "image": "reg/proj:1",
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
    # in its own image, in the harness's repository directory, with no network (no harness step needs one)
    assert inst.image == "reg/proj:1" and inst.environment.workdir == "/testbed" and not inst.environment.network
    for drop, field in (("image", "image"), ("eval_type", "eval_type"), ("log_parser", "log_parser")):
        path.write_text(json.dumps({k: v for k, v in rec.items() if k != drop}) + "\n")
        with pytest.raises(DatasetError, match=f"v.jsonl:1: missing field '{field}'"):
            load_swe_bench(path)


# --- Terminal-Bench 1 and Harbor task directories -------------------------------------------------

TB1_RUN_TESTS = """\
#!/bin/bash
# a stand-in for `uv run pytest $TEST_DIR/test_outputs.py -rA`: pytest's -rA summary, written by bash
echo '=========================== short test summary info ============================'
if [ "$(cat greeting.txt 2>/dev/null)" = "$(cat "$TEST_DIR/expected.txt")" ]; then
  echo 'PASSED ../tests/test_outputs.py::test_greeting'
else
  echo 'FAILED ../tests/test_outputs.py::test_greeting - AssertionError'
fi
echo 'PASSED ../tests/test_outputs.py::test_seed_kept'
"""
HARBOR_TEST_SH = ('if [ "$(cat greeting.txt)" = "$(cat /tests/expected.txt)" ]; then echo 1 > /logs/verifier/reward.txt; '
                  'else echo 0 > /logs/verifier/reward.txt; fi\n')  # fmt: skip
HARBOR_TOML = ('version = "1.0"\n[metadata]\ndifficulty = "easy"\n[verifier]\ntimeout_sec = 30.0\n'
               '[agent]\ntimeout_sec = 60.0\n[environment]\nallow_internet = false\n')


def _tb1(root, name, **over):
    d = root / name
    (d / "tests").mkdir(parents=True)
    (d / "task.yaml").write_text(over.get("yaml", "instruction: |\n  Write hello into greeting.txt.\n"
                                                  "max_test_timeout_sec: 20\nmax_agent_timeout_sec: 40\n"))
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
    (d / "task.toml").write_text(over.get("toml", HARBOR_TOML))
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
    # the image is tagged by its build context's content: an edited task is built again
    assert h.image.startswith("megathunder-tb/hello-harbor:") and h.build is not None
    assert h.build.dockerfile == str(harbor / "environment" / "Dockerfile") and h.build.context == str(harbor / "environment")
    assert t.build is not None and t.build.dockerfile == str(tb1 / "Dockerfile")
    # the environment's files for the local sandbox (at the Dockerfile's WORKDIR); tests and solutions never among them
    assert set(h.files) == {"data.txt"} and set(t.files) == {"seed.txt"}
    assert h.environment.local.workdir == t.environment.local.workdir == "/app"
    assert set(t.metadata["tests"]) == {"run-tests.sh", "expected.txt"} and set(h.metadata["tests"]) == {"test.sh", "expected.txt"}
    # the harness's limits: the agent's and the test run's own, the network (TB1: always; Harbor: allow_internet)
    assert (t.test_timeout_s, t.agent_timeout_s, t.environment.network) == (20, 40, True)
    assert (h.test_timeout_s, h.agent_timeout_s, h.environment.network) == (30, 60, False)
    (harbor / "environment" / "data.txt").write_text("changed\n")
    (h2,), _ = load_task_dirs(harbor)
    assert h2.image != h.image
    # a prebuilt image named in task.toml replaces the built one, and allow_internet defaults to true
    (harbor / "task.toml").write_text('[environment]\ndocker_image = "registry.local/hello:1"\ncpus = 2\nmemory = "3G"\n'
                                      'workdir = "/srv"\n')
    (h3,), _ = load_task_dirs(harbor)
    env = h3.environment
    assert h3.image == "registry.local/hello:1" and h3.build is None and env.network
    assert (env.cpus, env.memory_mb, env.workdir) == (2, 3072, "/srv") and "prebuilt image" in env.local.refusal
    (harbor / "task.toml").write_text("[environment]\nmemory_mb = 512\n")
    assert load_task_dirs(harbor)[0][0].environment.memory_mb == 512


def test_what_the_local_sandbox_can_lay_out_of_a_dockerfile(tmp_path):
    """Files copied into the WORKDIR are laid out; a RUN step, a copy elsewhere or a one-service
    compose file's other settings are refusals naming the file and line."""
    from megathunder.rollout.tasks.dockerfile_layout import local_layout

    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.py").write_text("a\n")
    (tmp_path / "b.txt").write_text("b\n")
    df = tmp_path / "Dockerfile"
    df.write_text("# syntax=docker/dockerfile:1\nFROM base AS x\nWORKDIR /app\nCOPY src/ ./lib/\n"
                  "COPY --chown=1:1 b.txt \\\n  /app/data/\nCMD [\"bash\"]\n")
    layout = local_layout(df, tmp_path)
    assert layout.refusal is None and layout.workdir == "/app"
    assert layout.files == {"lib/a.py": b"a\n", "data/b.txt": b"b\n"}
    for text, why in (("FROM x\nWORKDIR /app\nRUN apt-get install -y curl\n", "Dockerfile:3: RUN apt-get"),
                      ("FROM x\nWORKDIR /app\nCOPY b.txt /etc/b.txt\n", "copies /etc/b.txt, outside its work directory"),
                      ("FROM x\nWORKDIR /app\nENV A=1\n", "Dockerfile:3: ENV A=1"),
                      ("FROM x\nCOPY b.txt /b.txt\n", "no WORKDIR"),
                      ("FROM x\nWORKDIR /app\nCOPY --from=build /x /app/x\n", "not a copy of the build context")):
        df.write_text(text)
        assert why in (local_layout(df, tmp_path).refusal or ""), text


def test_terminal_bench_1_results_are_its_pytest_parser_s():
    """Solved when every test of the pytest summary passed (skipped and xfail count as passed);
    no summary means the tests never ran: an infrastructure failure, not a 0."""
    out = ("===== short test summary info =====\nPASSED tests/test_outputs.py::test_a\n"
           "SKIPPED tests/test_outputs.py::test_b\nFAILED tests/test_outputs.py::test_c - assert 0\n")
    assert tb1_pytest_results(out) == {"tests/test_outputs.py::test_a": "PASSED", "tests/test_outputs.py::test_b": "SKIPPED",
                                       "tests/test_outputs.py::test_c": "FAILED"}
    for bad in ("curl: (6) Could not resolve host: astral.sh\nbash: uv: command not found\n",
                "===== short test summary info =====\n"):
        with pytest.raises(GradingError):
            tb1_pytest_results(bad)


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
    """The local sandbox lays each task's environment out at its own paths (its WORKDIR, /tests,
    /logs): the task's own test scripts run unchanged. The tests are not there during the episode."""
    tasks = tmp_path / "tasks"
    _tb1(tasks, "hello-tb1")
    _harbor(tasks, "hello-harbor")
    task = TerminalBenchTask(str(tasks))
    insts = task.instances(2)
    local = {"network": "none"}  # Terminal-Bench 1's harness gives a network, which the local sandbox has not
    episodes, _ = run_scripted(task, insts, tmp_path, sandbox=local)
    assert [ep.reward.reward for ep in episodes] == [1.0, 1.0], [ep.reward for ep in episodes]
    assert episodes[1].reward.tests == {"../tests/test_outputs.py::test_greeting": "PASSED",
                                        "../tests/test_outputs.py::test_seed_kept": "PASSED"}
    look = tool_call_text("bash", command="pwd; ls -a; ls /tests 2>&1 | head -3")
    episodes, _ = run_scripted(task, insts, tmp_path, scripts={i.prompt: [look, "Done."] for i in insts}, sandbox=local)
    for inst, ep in zip(insts, episodes, strict=True):
        seen = ep.turns[0].tool_runs[0].observation
        assert seen.startswith("/app\n") and next(iter(inst.files)) in seen and "expected.txt" not in seen
        assert ep.reward.reward == 0.0 and ep.reward.status == "ok"
    # a Harbor test script that writes no reward file: an infrastructure failure (never a 0 that trains)
    (tasks / "hello-harbor" / "tests" / "test.sh").write_text("true\n")
    task = TerminalBenchTask(str(tasks))
    (ep, _), _ = run_scripted(task, task.instances(2), tmp_path, sandbox=local, verifier={"on_infra_failure": "drop_group"})
    assert ep.reward.status == "error" and ep.reward.infra and "no reward file" in ep.reward.detail
    assert ep.reward.reward is None and ep.reward.drop_group


@needs_root
def test_the_local_sandbox_refuses_an_environment_it_cannot_provide(tmp_path):
    """The lying reward: a Harbor task whose test compares the file the agent must write with one
    its environment makes (a RUN step). Run without that environment, both sides were empty and a
    do-nothing agent scored 1.0; now the local sandbox refuses the task, naming it and the step,
    as an infrastructure failure of the episode (its group dropped, not a reward)."""
    tasks = tmp_path / "tasks"
    d = _harbor(tasks, "made-by-run")
    (d / "environment" / "Dockerfile").write_text("FROM megathunder/base\nWORKDIR /app\nRUN echo 42 > /app/expected\n")
    (d / "tests" / "test.sh").write_text('[ "$(cat /app/answer 2>/dev/null)" = "$(cat /app/expected 2>/dev/null)" ] '
                                        '&& echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n')
    _harbor(tasks, "needs-network", toml='[environment]\nallow_internet = true\n')
    task = TerminalBenchTask(str(tasks))
    insts = task.instances(2)
    from megathunder.config import AgentLoopConfig, VerifierConfig
    from megathunder.rollout.agent_loop import AgentLoop
    from megathunder.rollout.scripted import ScriptedPolicy
    from megathunder.rollout.verifiers import VerifierPool
    from tests.rollout_helpers import codec

    c = codec()
    loop = AgentLoop(ScriptedPolicy(c, {i.prompt: ["Done."] for i in insts}), c, task, AgentLoopConfig(),
                     sandbox_cfg(tmp_path), VerifierPool(VerifierConfig(on_infra_failure="drop_group")))
    with pytest.raises(SandboxError, match="no sandbox of the batch could be set up"):
        asyncio.run(loop.run_batch(insts, 1))
    eps = [asyncio.run(loop.run_episode(i, traj_id=k, group_id=k)) for k, i in enumerate(insts)]
    why = {ep.instance_id: ep.reward.detail for ep in eps}
    assert all(ep.reward.infra and ep.reward.drop_group and ep.reward.reward is None for ep in eps)
    assert "task made-by-run: the local sandbox cannot provide its environment" in why["made-by-run"]
    assert "Dockerfile:3: RUN echo 42" in why["made-by-run"]
    assert "gives it a network" in why["needs-network"]
    with pytest.raises(SandboxError, match="sandbox.isolation=bwrap"):
        LocalSandbox(LocalSandboxConfig(isolation="unshare", network="none"), insts[1].environment)


@needs_root
def test_swe_test_timeout_gets_the_failure_policy(tmp_path):
    task = SweLocalTask()
    inst = task.instances(1, seed=2)[0]
    slow = dataclasses.replace(inst, test_timeout_s=0.5, metadata={**inst.metadata, "eval_script": f"echo '{START}'\nsleep 5\n"})
    (ep,), _ = run_scripted(task, [slow], tmp_path, scripts={slow.prompt: ["Done."]},
                            verifier={"on_failure": "drop_group"})
    assert ep.reward.status == "timeout" and ep.reward.drop_group and "exceeded 0.5 s" in ep.reward.detail


@needs_root
def test_swe_smith_set_up_and_the_harness_s_evaluation_state(tmp_path):
    """SWE-smith: set-up checks the instance's branch out (bug commit, then a commit removing the
    FAIL_TO_PASS test file), else applies the record's bug patch, else fails naming both. Grading
    rebuilds SWE-smith's evaluation state in place: the branch's parent (the tests back) with the
    agent's changes applied and the record's test files reverted; a change that does not apply
    there prints the harness's apply-failure marker. (The local sandbox has no image: set-up
    commands make the image's repository here.)"""
    good = "def double(x):\n    return 2 * x\n"
    bug = ("diff --git a/mod.py b/mod.py\n--- a/mod.py\n+++ b/mod.py\n@@ -1,2 +1,2 @@\n def double(x):\n"
           "-    return 2 * x\n+    return x + x + 1\n")  # fmt: skip
    test = "import unittest\nfrom mod import double\n\n\nclass T(unittest.TestCase):\n    def test_double(self):\n        self.assertEqual(double(4), 8)\n"
    git = "git -c user.name=t -c user.email=t@t"
    iid = "toy__mod.abc123.lm_1"
    image_repo = f"git init -q -b main && git add -A && {git} commit -qm base"
    with_branch = (f"{image_repo} && git checkout -q -b {iid} && git apply .bug.patch && rm .bug.patch && {git} commit -qam bug "
                   f"&& git rm -q test_mod.py && {git} commit -qm 'remove F2P tests' && git checkout -q main")

    async def go(prepare: str, agent: str):
        sb = LocalSandbox(sandbox_cfg(tmp_path))
        try:
            await sb.upload({"mod.py": good, "test_mod.py": test, "test_other.py": "# other\n", ".bug.patch": bug})
            assert (await sb.shell(prepare)).ok
            setup = await sb.shell(swe_smith_setup(iid, bug)[0])
            seen = await sb.shell("git branch --show-current; cat mod.py; ls")
            await sb.shell(agent)
            eval_path = f"{sb.tmp_dir}/.megathunder_eval.sh"  # outlives a command, and the grade script's clean-up
            await sb.write_file(eval_path, "git log --format=%s -1; cat mod.py; head -1 test_mod.py; cat test_other.py\n")
            grade = swe_smith_grade_script(iid, ["test_mod.py", "test_other.py"], eval_path)
            await sb.write_file(f"{sb.tmp_dir}/.megathunder_grade.sh", grade)
            return setup, seen, await sb.exec(["bash", f"{sb.tmp_dir}/.megathunder_grade.sh"])
        finally:
            await sb.close()

    fix = "sed -i 's/x + x + 1/2 * x/' mod.py && echo '# edited' > test_other.py"
    setup, seen, graded = asyncio.run(go(with_branch, fix))
    assert setup.ok and seen.output.startswith(iid) and "x + x + 1" in seen.output and "test_mod.py" not in seen.output
    # the bug commit (the removed tests back) with the agent's fix; the test files as the harness has them
    assert graded.output.splitlines() == ["bug", "def double(x):", "    return 2 * x", "import unittest", "# other"]
    setup, seen, graded = asyncio.run(go(with_branch, "printf 'import os\\n' > test_mod.py"))  # clashes with the parent
    assert ">>>>> Patch Apply Failed" in graded.output
    setup, seen, graded = asyncio.run(go(image_repo, fix))  # no branch: the bug patch applied on main
    assert seen.output.startswith("main") and "x + x + 1" in seen.output
    assert "    return 2 * x" in graded.output and "import unittest" in graded.output
    no_patch = asyncio.run(_setup_without_patch(tmp_path, image_repo, iid))
    assert not no_patch.ok and f"no branch {iid} in the repository, and the record has no patch" in no_patch.output


async def _setup_without_patch(tmp_path, image_repo: str, iid: str):
    sb = LocalSandbox(sandbox_cfg(tmp_path))
    try:
        await sb.upload({"mod.py": "x = 1\n"})
        await sb.shell(image_repo)
        return await sb.shell(swe_smith_setup(iid, "")[0])
    finally:
        await sb.close()
