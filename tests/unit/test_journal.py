"""The run journal: round trip, crash consistency (torn and corrupted records), resume cut-back."""

from __future__ import annotations

import torch

from megathunder.trainer.journal import Journal, completed_steps, read_records
from megathunder.trajectory import Trajectory


def _traj(tid: int, gid: int, n: int = 6) -> Trajectory:
    tokens = torch.arange(n) + tid
    mask = torch.tensor([False, True, True, False, True][: n - 1] + [True] * max(0, n - 6))
    return Trajectory(tid, gid, tokens, mask, rollout_logprobs=torch.linspace(-1.5, -0.1, n - 1))


def _write(path, steps: int, per_step: int = 4) -> None:
    j = Journal(path)
    for step in range(steps):
        for tid in range(per_step):
            j.trajectory(step, _traj(tid, tid // 2), reward=float(tid % 2), t_finished=0.1 * tid,
                         t_reward=0.2 + 0.1 * tid, policy_versions=[step])
        j.end_step(step, {"reward_mean": 0.5})
    j.close()


def test_round_trip_is_exact(tmp_path):
    path = tmp_path / "journal.jsonl"
    _write(path, steps=2)
    steps = list(completed_steps(path))
    assert [s for s, _, _ in steps] == [0, 1]
    entries = steps[1][1]
    for tid, e in enumerate(entries):
        ref = _traj(tid, tid // 2)
        assert torch.equal(e.traj.tokens, ref.tokens)
        assert torch.equal(e.traj.loss_mask, ref.loss_mask)
        assert torch.equal(e.traj.rollout_logprobs, ref.rollout_logprobs)  # float32 bit-exact
        assert e.reward == float(tid % 2) and e.policy_versions == [1]


def test_torn_last_record_is_skipped_and_step_without_end_is_not_replayed(tmp_path):
    path = tmp_path / "journal.jsonl"
    _write(path, steps=2)
    j = Journal(path, keep_steps=2)
    j.trajectory(2, _traj(0, 0), reward=1.0, t_finished=0.0, t_reward=0.1, policy_versions=[2])
    j.close()
    with open(path, "a") as f:
        f.write('{"crc": 1, "rec": {"type": "traj')  # the crash: half a record
    records = read_records(path)
    assert sum(r["type"] == "step" for r in records) == 2
    assert [s for s, _, _ in completed_steps(path)] == [0, 1]  # step 2 never ended


def test_corrupted_record_is_detected(tmp_path):
    path = tmp_path / "journal.jsonl"
    _write(path, steps=1)
    lines = path.read_text().splitlines()
    lines[1] = lines[1].replace('"reward":1.0', '"reward":0.0')  # a flipped value, CRC unchanged
    path.write_text("\n".join(lines) + "\n")
    assert len(read_records(path)) == len(lines) - 1


def test_resume_cuts_back_to_the_checkpointed_steps(tmp_path):
    path = tmp_path / "journal.jsonl"
    _write(path, steps=3)
    Journal(path, keep_steps=1).close()
    assert [s for s, _, _ in completed_steps(path)] == [0]
    assert all(r["step"] < 1 for r in read_records(path))


def test_a_steps_records_reach_the_file_with_its_step_record(tmp_path):
    """A step's trajectory records are written with its ``step`` record, in one write (a step counts
    only once that record is on disk); ``close`` writes an unfinished step's records, which do not
    count, as they were written before."""
    path = tmp_path / "journal.jsonl"
    j = Journal(path)
    j.trajectory(0, _traj(0, 0), reward=1.0, t_finished=0.0, t_reward=0.1, policy_versions=[0])
    assert read_records(path) == []
    j.end_step(0, {"reward_mean": 1.0})
    assert [r["type"] for r in read_records(path)] == ["trajectory", "step"]
    j.trajectory(1, _traj(0, 0), reward=0.0, t_finished=0.0, t_reward=0.1, policy_versions=[1])
    j.close()
    assert [r["type"] for r in read_records(path)] == ["trajectory", "step", "trajectory"]
    assert [s for s, _, _ in completed_steps(path)] == [0]
