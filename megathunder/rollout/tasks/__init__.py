"""Tasks: generated ones (arithmetic, calculator, swe_local, terminal) and benchmark loaders
(SWE-bench Verified and SWE-smith records, Terminal-Bench 1 / Harbor task directories)."""

from __future__ import annotations

from megathunder.config import TaskConfig, TerminalBenchTaskConfig
from megathunder.rollout.tasks import datasets
from megathunder.rollout.tasks.arithmetic import ArithmeticTask
from megathunder.rollout.tasks.calculator import CalculatorTask
from megathunder.rollout.tasks.swe_local import SweLocalTask
from megathunder.rollout.tasks.task import DatasetTask, Task, TaskInstance
from megathunder.rollout.tasks.terminal import TerminalTask
from megathunder.rollout.tasks.terminal_bench import TerminalBenchTask


def build_task(cfg: TaskConfig) -> Task:
    """The task a run's ``task`` section names (build it once per run)."""
    if cfg.name == "arithmetic":
        return ArithmeticTask(cfg.max_operand)
    if cfg.name == "calculator":
        return CalculatorTask(cfg.max_operand)
    if cfg.name == "swe_local":
        return SweLocalTask()
    if cfg.name == "terminal":
        return TerminalTask()
    if isinstance(cfg, TerminalBenchTaskConfig):
        return TerminalBenchTask(cfg.path, cfg.test_run)
    loader = {"swe_bench": datasets.load_swe_bench, "swe_smith": datasets.load_swe_smith}[cfg.name]
    return datasets.ContainerTestTask(cfg.name, loader, cfg.path, cfg.test_run, cfg.harness_python)


__all__ = ["DatasetTask", "Task", "TaskInstance", "build_task"]
