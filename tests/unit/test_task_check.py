"""``megathunder tasks check`` in the local sandbox: each task's oracle and a do-nothing agent, the
planted false positive and broken oracle found among good tasks, the environment the local sandbox
cannot provide reported as such, and ``task.check_before_training`` dropping or refusing them."""

from __future__ import annotations

import json

import pytest

from megathunder.cli import main
from megathunder.config import ConfigError, load_config
from megathunder.rollout.tasks import build_task
from megathunder.rollout.tasks.task_check import check_before_training
from tests.rollout_helpers import needs_root
from tests.task_sets import SOLVED, UPPER, checked_set, harbor_task

LOCAL = ["sandbox.root_dir=/tmp/megathunder-test-sandboxes", "sandbox.network=none", "sandbox.wall_time_s=20",
         "sandbox.memory_mb=512", "task.test_run.wall_time_s=30", "agent.episode_wall_time_s=60"]


@needs_root
def test_check_finds_the_planted_tasks_in_the_local_sandbox(tmp_path, capsys):
    expected = checked_set(tmp_path / "tasks")
    made = harbor_task(tmp_path / "tasks", "harbor-needs-a-build", "localhost/megathunder-base", check=SOLVED,
                       solution=UPPER, dockerfile_extra="RUN echo built > /app/built.txt\n")
    expected[made.name] = ["env_error"]
    code = main(["tasks", "check", str(tmp_path / "tasks"), "--set", *LOCAL, "--concurrency", "2"])
    out = capsys.readouterr().out
    report = json.loads(out.strip().splitlines()[-1])
    got = {row["task"]: row["problems"] for row in report["tasks"]}
    assert got == expected, out
    assert code == 1 and not report["ok"] and report["sandbox"] == "local"
    rows = {row["task"]: row for row in report["tasks"]}
    good = rows["harbor-good"]
    assert good["oracle"]["reward"] == 1.0 and good["null"]["reward"] == 0.0 and good["oracle"]["test_s"] > 0
    assert rows["harbor-false-positive"]["null"]["reward"] == 1.0
    assert rows["harbor-broken-oracle"]["oracle"]["reward"] == 0.0
    assert "Dockerfile:4: RUN echo built" in rows["harbor-needs-a-build"]["detail"]
    assert "harbor-false-positive: false_positive" in out and "2 of 5 tasks ok" in out  # the table's summary


@needs_root
@pytest.mark.parametrize("mode", ["drop", "refuse"])
def test_check_before_training_drops_or_refuses_the_bad_tasks_by_name(tmp_path, mode):
    checked_set(tmp_path / "tasks")
    cfg = load_config(None, [*LOCAL, "task.name=terminal_bench", f"task.path={tmp_path / 'tasks'}",
                             f"task.check_before_training={mode}"])
    task = build_task(cfg.task)
    barriers = []
    if mode == "refuse":
        with pytest.raises(ConfigError, match="task.check_before_training=refuse: 2 task.*harbor-broken-oracle "
                                              r"\(broken_oracle\), harbor-false-positive \(false_positive\)"):
            check_before_training(cfg, task, tmp_path, rank=0, barrier=lambda: barriers.append(1))
    else:
        check_before_training(cfg, task, tmp_path, rank=0, barrier=lambda: barriers.append(1))
        assert sorted(i.instance_id for i in task.all_instances()) == ["harbor-good", "tb1-good"]
        # another rank reads the same report after the barrier, and drops the same tasks without checking
        other = build_task(cfg.task)
        check_before_training(cfg, other, tmp_path, rank=1, barrier=lambda: barriers.append(1))
        assert [i.instance_id for i in other.all_instances()] == [i.instance_id for i in task.all_instances()]
    assert barriers and (tmp_path / "tasks_check.json").is_file()
