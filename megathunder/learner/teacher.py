"""OPD's teacher on the learner ranks: a frozen, forward-only GPTModel from a Hugging Face checkpoint.

Any size, the student's vocabulary; sharded like the student (its parallel layout and precision)
with past-K/V attention, and wrapped as a ``CachedTeacher``: each completed turn is scored on top
of the trajectory's cached teacher K/V, never re-scoring the prefix.
"""

from __future__ import annotations

from pathlib import Path

from megathunder.config import LearnerConfig
from megathunder.learner import hf
from megathunder.learner.model import build_gpt_model, layer_offset, resolve_model_config
from megathunder.learner.parallel import ProcessGroups
from megathunder.learner.segment_model import MegatronSegmentModel
from megathunder.streaming.opd_turns import CachedTeacher


def build_teacher(hf_dir: str | Path, student_cfg: LearnerConfig, pgs: ProcessGroups) -> CachedTeacher:
    """The teacher in ``hf_dir`` as a ``CachedTeacher`` in the student's layout and precision."""
    precision = student_cfg.precision.model_copy(update={"core_attention": "past_kv"})
    model_cfg = resolve_model_config(student_cfg.model, hf_dir)
    model = build_gpt_model(model_cfg, precision, pgs)
    hf.load_hf(model, hf_dir, model_cfg, pgs, layer_offset(model_cfg, pgs))  # this rank's slices only
    model.requires_grad_(False).eval()
    return CachedTeacher(MegatronSegmentModel(model, pgs))
