"""evaluate() through the real agent loop on canned completions (a deterministic policy, real
tokenizer, the arithmetic task's real verifier): expected pass@k, crashing verifiers recorded per
instance, missing samples refused; the held-out split."""

from __future__ import annotations

import asyncio
import json
import math
import statistics

import pytest

from megathunder.config import AgentLoopConfig, Config, GeneratedTaskConfig, LocalTaskConfig, VerifierConfig
from megathunder.config import EvalConfig
from megathunder.eval import MissingSamplesError, evaluate
from megathunder.eval.instances import eval_instances
from megathunder.rollout.chat import IM_START
from megathunder.rollout.scripted import ScriptedPolicy
from megathunder.rollout.tasks import build_task
from megathunder.rollout.tasks.arithmetic import ArithmeticTask
from megathunder.rollout.tasks.split import InstanceDrawError, draw_instances, is_held_out, training_instances
from tests.rollout_helpers import codec, needs_root

ENGINE_CRASH = "<engine crash>"


class CannedPolicy(ScriptedPolicy):
    """Each call for a prompt returns that prompt's next canned answer (one turn per episode)."""

    def __init__(self, c, answers: dict[str, list[str]]) -> None:
        super().__init__(c, {})
        self.answers = {user: list(texts) for user, texts in answers.items()}

    def _turn_text(self, prompt_ids) -> str:
        text = self.codec.decode(prompt_ids)
        user = text.split(f"{IM_START}user\n", 1)[1].split("<|im_end|>", 1)[0]
        answer = self.answers[user].pop(0)
        if answer == ENGINE_CRASH:
            raise RuntimeError("engine died")
        return answer


def _cfg(k: int = 4, **kw) -> Config:
    return Config(
        task=GeneratedTaskConfig(name="arithmetic"),
        agent=AgentLoopConfig(max_total_tokens=512, max_new_tokens_per_turn=64),
        eval=EvalConfig(k=k, num_instances=4, seed=5),
        **kw,
    )


def _answers(insts, passes: list[list[bool]], override=None) -> dict[str, list[str]]:
    out = {}
    for g, (inst, row) in enumerate(zip(insts, passes, strict=True)):
        texts = [f"It is {inst.answer}." if ok else f"It is {inst.answer + 7}." for ok in row]
        for (gg, s), text in (override or {}).items():
            if gg == g:
                texts[s] = text
        out[inst.prompt] = texts
    return out


PASSES = [[False] * 4, [True, False, False, False], [True, False, True, False], [True] * 4]
# num_correct per instance: 0, 1, 2, 4 (pass@j computed by hand in the test below)


def _run(cfg, answers, insts, task=None, **kw):
    policy = CannedPolicy(codec(), answers)
    return asyncio.run(evaluate(cfg, policy, policy.codec, task or build_task(cfg.task), insts, **kw))


def test_expected_pass_at_k_on_canned_completions():
    cfg = _cfg()
    insts = eval_instances(cfg, build_task(cfg.task))
    result = _run(cfg, _answers(insts, PASSES), insts)
    assert [i.num_correct for i in result.instances] == [0, 1, 2, 4]
    assert [i.instance_id for i in result.instances] == [i.instance_id for i in insts]
    scores = result.pass_at_all()
    # by hand: pass@2 of c=1 of 4 is 1 - C(3,2)/C(4,2) = 1/2; of c=2: 1 - 1/6 = 5/6
    expected = {1: 0.4375, 2: (0 + 0.5 + 5 / 6 + 1) / 4, 3: (0 + 0.75 + 1 + 1) / 4, 4: 0.75}
    for j, value in expected.items():
        assert scores[j][0] == pytest.approx(value, abs=1e-12)
    assert scores[1][1] == pytest.approx(statistics.stdev([0, 0.25, 0.5, 1]) / 2)
    assert result.num_instances == 4 and result.num_failed == 0
    assert result.policy_versions == [0]

    m = result.metrics()
    assert m["eval/pass@1"] == pytest.approx(0.4375) and "eval/pass@4_stderr" in m
    assert m["eval/num_episodes"] == 16 and m["eval/num_generated_tokens"] > 16
    assert m["eval/mean_reward"] == pytest.approx(7 / 16)
    data = json.loads(json.dumps(result.to_json()))
    assert data["scores"]["pass@4"]["mean"] == pytest.approx(0.75) and data["error"] is None
    sample = data["instances"][3]["samples"][0]
    assert sample["status"] == "ok" and sample["passed"] and sample["stop_reason"] == "answered"


def test_pass_reward_threshold():
    cfg = _cfg()
    insts = eval_instances(cfg, build_task(cfg.task))
    result = _run(cfg, _answers(insts, PASSES), insts, pass_reward=1.5)  # rewards are 0 / 1
    assert result.pass_at(4)[0] == 0.0


class _CrashingArithmetic(ArithmeticTask):
    async def verify(self, inst, episode, sandbox) -> float:
        if "boom" in episode.final_text:
            raise ZeroDivisionError("verifier bug")
        return await super().verify(inst, episode, sandbox)


@pytest.mark.parametrize(
    "verifier",
    [VerifierConfig(), VerifierConfig(on_failure="drop_group"), VerifierConfig(failure_reward=1.0)],
    ids=["zero_reward", "drop_group", "failure_reward_1"],
)
def test_crashing_verifier_is_a_recorded_failure_never_a_dropped_instance(verifier):
    cfg = _cfg(verifier=verifier)
    insts = eval_instances(cfg, ArithmeticTask())
    # instance 3 would pass 4/4, but one verifier crashes on a correct-looking answer
    override = {(3, 1): f"boom {insts[3].answer}", (1, 2): "boom"}
    result = _run(cfg, _answers(insts, PASSES, override), insts, task=_CrashingArithmetic())
    assert result.num_instances == 4 and result.num_failed == 2
    assert result.num_samples_with("verifier_error") == 2
    crashed = result.instances[3].samples[1]
    assert crashed.status == "verifier_error" and not crashed.passed
    assert "ZeroDivisionError: verifier bug" in crashed.detail
    assert [i.num_samples for i in result.instances] == [4, 4, 4, 4]
    assert [i.num_correct for i in result.instances] == [0, 1, 2, 3]
    # all four instances in the mean: (0 + 1/4 + 2/4 + 3/4) / 4
    assert result.pass_at(1)[0] == pytest.approx(0.375)
    assert result.metrics()["eval/num_failed"] == 2


def test_missing_samples_refuse_a_score():
    cfg = _cfg()
    insts = eval_instances(cfg, build_task(cfg.task))
    result = _run(cfg, _answers(insts, PASSES, {(2, 3): ENGINE_CRASH}), insts)
    assert result.instances[2].samples[3].status == "episode_error"
    assert "engine died" in result.instances[2].samples[3].detail
    assert result.num_instances == 4 and result.instances[2].num_samples == 3
    with pytest.raises(MissingSamplesError, match="1 of the 4 instances"):
        result.pass_at(1)
    with pytest.raises(MissingSamplesError):
        result.metrics()
    data = result.to_json()
    assert data["scores"] is None and "fewer than" in data["error"]
    assert data["num_missing_samples"] == 1
    with pytest.raises(ValueError, match="drew 4 samples"):
        _run(cfg, _answers(insts, PASSES), insts).pass_at(5)


def test_duplicate_and_empty_instances_are_refused():
    cfg = _cfg()
    insts = eval_instances(cfg, build_task(cfg.task))
    with pytest.raises(ValueError, match="duplicate"):
        _run(cfg, {}, [insts[0], insts[0]])
    with pytest.raises(ValueError, match="no instances"):
        _run(cfg, {}, [])
    with pytest.raises(ValueError, match="greedy"):
        _run(cfg, {}, insts, temperature=0.0)


def test_held_out_split_is_disjoint_from_training_by_content():
    task = ArithmeticTask(max_operand=20)
    held = draw_instances(task, 40, seed=0, held_out=True, heldout_fraction=0.1)
    train = draw_instances(task, 300, seed=0, held_out=False, heldout_fraction=0.1)
    assert len({i.prompt for i in held}) == 40 and all(is_held_out(i, 0.1) for i in held)
    assert not {i.prompt for i in held} & {i.prompt for i in train}
    # reproducible
    again = draw_instances(task, 40, seed=0, held_out=True, heldout_fraction=0.1)
    assert [i.prompt for i in again] == [i.prompt for i in held]
    # the held-out share is about the fraction asked for
    everything = draw_instances(task, 400, seed=1, held_out=None)
    share = sum(is_held_out(i, 0.1) for i in everything) / len(everything)
    assert 0.05 < share < 0.15


def test_trainer_helpers_keep_the_split():
    from megathunder.eval import eval_due

    cfg = _cfg()
    cfg.eval.num_instances = 30
    task = build_task(cfg.task)
    held = {i.prompt for i in eval_instances(cfg, task)}
    for seed in range(5):  # the trainer varies the seed per batch; the split holds for every one
        batch = training_instances(cfg, task, 16, seed=cfg.eval.seed + seed)
        assert len(batch) == 16 and not held & {i.prompt for i in batch}
    cfg.eval.every_n_steps = 3
    assert [s for s in range(1, 10) if eval_due(cfg, s)] == [3, 6, 9]
    cfg.eval.every_n_steps = 0
    assert not any(eval_due(cfg, s) for s in range(1, 10))


def test_too_few_distinct_instances_is_an_error():
    tiny = ArithmeticTask(max_operand=1)  # 8 distinct problems
    with pytest.raises(InstanceDrawError, match="only 8 distinct instances"):
        draw_instances(tiny, 9, seed=0, held_out=None)
    assert len(draw_instances(tiny, 8, seed=0, held_out=None)) == 8


def test_eval_config_validation():
    from megathunder.config import ConfigError, load_config

    assert load_config(None, ["eval.k=1", "eval.temperature=0"]).eval.temperature == 0
    with pytest.raises(ConfigError, match=r"eval\.k: 4 greedy samples"):
        load_config(None, ["eval.temperature=0"])
    with pytest.raises(ConfigError, match=r"eval\.num_instances"):
        load_config(None, ["eval.num_instances=0"])
    with pytest.raises(ConfigError, match=r"eval\.every_n_steps"):
        load_config(None, ["eval.every_n_steps=-1"])
    with pytest.raises(ConfigError, match=r"eval\.bogus"):
        load_config(None, ["eval.bogus=1"])
    assert math.isclose(load_config(None, []).eval.heldout_fraction, 0.1)


@needs_root
def test_swe_local_through_sandboxes_counts_tool_cost():
    """The SWE-style task: the scripted fix through real sandboxes passes; tool calls are costed."""
    from megathunder.config import LocalSandboxConfig

    cfg = Config(
        task=LocalTaskConfig(name="swe_local"),
        agent=AgentLoopConfig(max_total_tokens=8192, max_new_tokens_per_turn=1024,
                              max_concurrent_episodes=4),
        sandbox=LocalSandboxConfig(root_dir="/tmp/megathunder-test-sandboxes", wall_time_s=5,
                              cpu_time_s=2, memory_mb=256, max_processes=16),
        eval=EvalConfig(k=2, num_instances=2, seed=3),
    )  # fmt: skip
    task = build_task(cfg.task)
    insts = eval_instances(cfg, task)
    c = codec()
    # instance 0: the correct script; instance 1: gives up after running the tests
    scripts = {insts[0].prompt: task.scripted_turns(insts[0]),
               insts[1].prompt: [task.scripted_turns(insts[1])[1], "I give up."]}  # fmt: skip
    result = asyncio.run(evaluate(cfg, ScriptedPolicy(c, scripts), c, task, insts))
    assert [i.num_correct for i in result.instances] == [2, 0]
    assert result.pass_at(1) == (0.5, 0.5) and result.num_failed == 0
    cost = result.cost()
    assert cost["num_tool_calls"] == 2 * 4 + 2 * 1 and cost["tool_s"] > 0
    assert cost["num_tool_errors"] == 0  # the visible tests pass with the bug; the hidden ones fail at grading
    (_, wrong) = result.instances
    assert all(s.tests is not None and "FAILED" in s.tests.values() for s in wrong.samples)
