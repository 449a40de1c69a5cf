"""Evaluation: pass@k on held-out instances through the agent loop, and schedule comparisons."""

from megathunder.eval.evaluate import (
    EvalResult,
    InstanceOutcome,
    MissingSamplesError,
    SampleOutcome,
    evaluate,
)
from megathunder.eval.instances import EvalInputError, eval_due, eval_instances
from megathunder.eval.passk import pass_at_k, pass_at_k_over_instances

__all__ = [
    "EvalInputError",
    "EvalResult",
    "InstanceOutcome",
    "MissingSamplesError",
    "SampleOutcome",
    "eval_due",
    "eval_instances",
    "evaluate",
    "pass_at_k",
    "pass_at_k_over_instances",
]
