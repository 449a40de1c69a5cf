"""The root of a run's config: every section (one per component: ``run_config``,
``objective_config``, ``rollout_config``, ``learner_config``, ``chaos_config``), then the rules
that span sections (``megathunder.config.rules``, each naming the field it blames)."""

from __future__ import annotations

from pathlib import Path

from pydantic import field_validator, model_validator

from megathunder.config.base import Strict, default_tag
from megathunder.config.chaos_config import ChaosConfig
from megathunder.config.learner_config import LearnerConfig
from megathunder.config.objective_config import DistillObjective, GRPOObjective, LedgerConfig, ObjectiveConfig
from megathunder.config.rollout_config import (
    AgentLoopConfig,
    DatasetTaskConfig,
    GeneratedTaskConfig,
    LocalSandboxConfig,
    RolloutConfig,
    SandboxConfig,
    TaskConfig,
    VerifierConfig,
)
from megathunder.config.rules import RULES
from megathunder.config.run_config import (
    BatchConfig,
    EvalConfig,
    ExactnessConfig,
    ProbeConfig,
    RunConfig,
    ScheduleConfig,
    SftConfig,
)


class Config(Strict):
    run: RunConfig = RunConfig()
    schedule: ScheduleConfig = ScheduleConfig()
    probe: ProbeConfig = ProbeConfig()
    batch: BatchConfig = BatchConfig()
    objective: ObjectiveConfig = GRPOObjective()
    ledger: LedgerConfig = LedgerConfig()
    rollout: RolloutConfig = RolloutConfig()
    learner: LearnerConfig = LearnerConfig()
    agent: AgentLoopConfig = AgentLoopConfig()
    sandbox: SandboxConfig = LocalSandboxConfig()
    verifier: VerifierConfig = VerifierConfig()
    task: TaskConfig = GeneratedTaskConfig()
    eval: EvalConfig = EvalConfig()
    sft: SftConfig = SftConfig()
    exactness: ExactnessConfig = ExactnessConfig()
    chaos: ChaosConfig = ChaosConfig()

    @field_validator("objective", mode="before")
    @classmethod
    def _default_objective(cls, value: object) -> object:
        return default_tag(value, "kind", "grpo")

    @field_validator("sandbox", mode="before")
    @classmethod
    def _default_sandbox(cls, value: object) -> object:
        return default_tag(value, "backend", "local")

    @field_validator("task", mode="before")
    @classmethod
    def _default_task(cls, value: object) -> object:
        return default_tag(value, "name", "arithmetic")

    @model_validator(mode="after")
    def _rules(self) -> Config:
        """The rules that span sections (``megathunder.config.rules``), in order."""
        for rule in RULES:
            rule(self)
        return self


def check_paths(cfg: Config) -> None:
    """The files a run reads exist: the model, the teacher, the task file (a one-line
    ``ValueError`` naming the field). For commands that use them; ``megathunder config`` does not
    check, so a cluster config validates anywhere."""
    model = cfg.learner.model.hf_checkpoint
    if model is None and cfg.run.init_model != "tiny":
        model, field = cfg.run.init_model, "run.init_model"
    else:
        field = "learner.model.hf_checkpoint"
    if model is not None:
        _check_model_dir(field, Path(model))
    obj = cfg.objective
    if isinstance(obj, DistillObjective) and obj.teacher.hf_checkpoint is not None:
        _check_model_dir("objective.teacher.hf_checkpoint", Path(obj.teacher.hf_checkpoint))
    if isinstance(cfg.task, DatasetTaskConfig):
        path = Path(cfg.task.path)
        if cfg.task.name == "terminal_bench":  # a directory of task directories
            if not path.is_dir():
                raise ValueError(f"task.path: {path}: no such directory (Terminal-Bench / Harbor tasks)")
        elif not path.is_file():
            raise ValueError(f"task.path: {path}: no such file")
        try:
            path.open("rb").close()
        except OSError as err:
            raise ValueError(f"task.path: {path}: cannot be read ({err.strerror})") from None


def _check_model_dir(field: str, path: Path) -> None:
    if not path.is_dir():
        raise ValueError(f"{field}: {path}: no such directory (a Hugging Face model directory)")
    if not (path / "config.json").is_file():
        raise ValueError(f"{field}: {path} has no config.json (a Hugging Face model directory)")
    if not any(path.glob("*.safetensors")):
        raise ValueError(f"{field}: {path} has no *.safetensors weights")
