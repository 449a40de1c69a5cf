"""Evaluation: pass@k on held-out instances through the agent loop, and schedule comparisons."""

from megathunder.eval.evaluate import (
    EvalResult,
    InstanceOutcome,
    MissingSamplesError,
    SampleOutcome,
    evaluate,
)
from megathunder.eval.instances import (
    EvalInputError,
    draw_instances,
    eval_due,
    eval_instances,
    is_held_out,
    training_instances,
)
from megathunder.eval.passk import pass_at_k, pass_at_k_over_instances

__all__ = [
    "EvalInputError",
    "EvalResult",
    "InstanceOutcome",
    "MissingSamplesError",
    "SampleOutcome",
    "draw_instances",
    "eval_due",
    "eval_instances",
    "evaluate",
    "is_held_out",
    "pass_at_k",
    "pass_at_k_over_instances",
    "training_instances",
]
