"""Profiles parse strictly and name the field at fault; the CLI prints figures and one JSON line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megathunder.config import ConfigError
from megathunder.simulate import sim_metrics as metrics
from megathunder.simulate.profile import bundled_profiles, load_profile

ROOT = Path(__file__).resolve().parents[2]


def test_bundled_profiles_load_and_extend():
    assert {"swe_smith", "swe_smith_128"} <= set(bundled_profiles())
    small, big = load_profile("swe_smith"), load_profile("swe_smith_128")
    assert (small.name, big.name) == ("swe_smith", "swe_smith_128")
    assert small.num_gpus == 8 and big.num_gpus == 128
    assert big.num_dp == 6 and big.learner.pipeline_parallel == 2  # launch/slurm/grpo_128gpu.yaml: TP 8 x PP 2 x DP 6
    assert big.workload.turns == small.workload.turns  # inherited
    assert big.workload.batch_size == 4 * small.workload.batch_size  # 64 x 16 against 32 x 8


@pytest.mark.parametrize("override,field", [
    ("rollout.tensor_parallel=3", "cluster.num_rollout_gpus"),
    ("learner.mfu=1.5", "learner.mfu"),
    ("workload.turns.kind=empirical", "workload.turns.values"),
    ("workload.turn_count=3", "workload.turn_count"),
    ("rollout.decode_tokens_per_s=[[4,100],[2,200]]", "rollout.decode_tokens_per_s"),
    ("run.warmup_steps=9", "run.warmup_steps"),
])
def test_bad_profiles_fail_naming_the_field(override, field):
    with pytest.raises(ConfigError) as err:
        load_profile("swe_smith", [override])
    assert field in str(err.value)


def test_unknown_profile_lists_the_bundled_ones(tmp_path):
    with pytest.raises(ConfigError, match="swe_smith"):
        load_profile("no_such_profile")
    own = tmp_path / "mine.yaml"
    own.write_text("extends: swe_smith\nworkload: {samples_per_prompt: 4}\n")
    assert load_profile(own).workload.samples_per_prompt == 4


def test_empirical_lengths_are_sampled_from_the_data():
    p = load_profile("swe_smith", ["workload.turns={kind: empirical, values: [3, 7]}",
                                   "workload.max_context_tokens=1000000"])
    import numpy as np

    from megathunder.simulate.workload import sample_batch

    assert set(sample_batch(p.workload, np.random.default_rng(0)).num_turns) == {3, 7}


def test_cli_on_swe_smith_reports_the_published_comparison(tmp_path):
    # the published sync ran every trajectory: the MFU is fitted with zero advantages not skipped
    proc = subprocess.run([sys.executable, "-m", "megathunder.cli", "simulate", "swe_smith",
                           "trainer.objective.skip_zero_advantage=false", "--out", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    sched = result["schedules"]
    assert set(sched) == {"sync", "async", "fully_async", "thunder"}
    # the profile is calibrated to the published sync idle share
    assert abs(sched["sync"]["learner_idle_share"] - metrics.PUBLISHED_SYNC_IDLE_SHARE) < 0.05
    assert 1.0 < result["thunder_vs_sync"] <= result["B_arrival"] + 1e-6 <= result["B"] + 1e-6
    assert result["fraction_of_B"] == pytest.approx(result["thunder_vs_sync"] / result["B"], rel=1e-3)
    assert "overlap bound B" in proc.stdout
    for name in ("steps.csv", "timeline.csv", "summary.json", "timeline.png"):
        assert (tmp_path / name).stat().st_size > 0


def test_the_schedules_are_listed_once():
    """The config's list of schedules is the one the trainer, the simulator and the bench use."""
    from typing import get_args

    from megathunder.bench.schedule_runs import SCHEDULES as benched
    from megathunder.config import SCHEDULE_MODES, ScheduleMode
    from megathunder.simulate import SCHEDULES as simulated
    from megathunder.trainer.schedules import SCHEDULES as trained

    assert SCHEDULE_MODES == get_args(ScheduleMode) == simulated == benched and set(trained) == set(SCHEDULE_MODES)


def test_cli_help_mentions_simulate():
    proc = subprocess.run([sys.executable, "-m", "megathunder.cli", "--help"], capture_output=True,
                          text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 0 and "simulate" in proc.stdout


def test_fitted_lognormal_recovers_its_parameters():
    import numpy as np

    from megathunder.simulate.profile import Dist

    true = Dist(kind="lognormal", median=25.0, sigma=0.6)
    fit = Dist.fit(true.sample(np.random.default_rng(0), 20000))
    assert fit.median == pytest.approx(25.0, rel=0.02) and fit.sigma == pytest.approx(0.6, rel=0.02)
    assert Dist.fit([3, 7], kind="empirical").values == [3.0, 7.0]
