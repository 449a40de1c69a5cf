"""Tasks: generated ones (arithmetic, calculator, swe_local, terminal) and dataset loaders
(SWE-bench Verified, SWE-smith, Terminal-Bench)."""

from __future__ import annotations

from megathunder.tasks.base import Task, TaskInstance


def build_task(cfg) -> Task:
    """``cfg`` is a :class:`megathunder.config.TaskConfig`."""
    from megathunder.tasks import datasets
    from megathunder.tasks.arithmetic import ArithmeticTask
    from megathunder.tasks.calculator import CalculatorTask
    from megathunder.tasks.swe_local import SweLocalTask
    from megathunder.tasks.terminal import TerminalTask

    if cfg.name == "arithmetic":
        return ArithmeticTask(cfg.max_operand)
    if cfg.name == "calculator":
        return CalculatorTask(cfg.max_operand)
    if cfg.name == "swe_local":
        return SweLocalTask()
    if cfg.name == "terminal":
        return TerminalTask()
    loader = {
        "swe_bench": datasets.load_swe_bench,
        "swe_smith": datasets.load_swe_smith,
        "terminal_bench": datasets.load_terminal_bench,
    }[cfg.name]
    return datasets.ContainerTestTask(cfg.name, loader, cfg.path)


__all__ = ["Task", "TaskInstance", "build_task"]
