"""``megathunder bench episodes`` runs from the CLI table and ends with one JSON line."""

from __future__ import annotations

import json

from megathunder.cli import BENCHMARKS, main


def test_bench_episodes_prints_figures(capsys):
    assert BENCHMARKS["episodes"] == "megathunder.bench.episode_timing"
    argv = ["bench", "episodes", "--tasks", "arithmetic,calculator", "--num-instances", "2",
            "--samples-per-prompt", "2", "--seconds-per-token", "0.0005"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out.strip().splitlines()
    result = json.loads(out[-1])
    assert [t["task"] for t in result["tasks"]] == ["arithmetic", "calculator"]
    calc = result["tasks"][1]
    assert (
        calc["episodes"] == 4 and calc["mean_reward"] == 1.0 and calc["mean_episode"]["turns"] == 4
    )
    # the simulated decode time is a floor on the measured generation time
    assert calc["mean_episode"]["generation_s"] >= 0.0005 * calc["mean_generated_tokens"]
    q = calc["trajectory_finished_s"]
    assert 0 < q["p10"] <= q["p50"] <= q["p90"] <= q["max"] <= calc["batch_wall_s"]
