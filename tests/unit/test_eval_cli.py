"""``megathunder eval`` end to end with a canned policy in place of vLLM (the real engine is in
tests/integration/test_eval.py), and its bad inputs: missing or non-HF checkpoints, malformed task
records, too few instances -- each one line on stderr and exit code 2, before any engine starts."""

from __future__ import annotations

import json

import pytest

from megathunder import cli
from megathunder.config import load_config
from megathunder.eval.instances import eval_instances
from megathunder.models.local_tokenizer import train_local_chatml_tokenizer
from megathunder.rollout.tasks import build_task
from tests.unit.test_eval_evaluate import CannedPolicy

OVERRIDES = ["eval.k=2", "eval.num_instances=3", "eval.seed=11", "agent.max_total_tokens=512",
             "agent.max_new_tokens_per_turn=64"]  # fmt: skip


@pytest.fixture
def checkpoint(tmp_path):
    path = tmp_path / "ckpt"
    path.mkdir()
    (path / "config.json").write_text("{}")
    train_local_chatml_tokenizer().save(str(path / "tokenizer.json"))
    return path


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "eval.yaml"
    path.write_text("task:\n  name: arithmetic\neval:\n  k: 3\n")
    return path


@pytest.fixture
def no_engine(monkeypatch):
    """Fail the test if an engine is started."""
    import megathunder.rollout.engines as engines

    async def refuse(*a, **kw):
        raise AssertionError("the engine must not start on bad input")

    monkeypatch.setattr(engines, "start_engine", refuse)


def test_eval_prints_table_and_writes_json(tmp_path, config, checkpoint, monkeypatch, capsys):
    import megathunder.rollout.engines as engines
    from megathunder.rollout.chat import ChatMLCodec

    cfg = load_config(config, OVERRIDES)
    insts = eval_instances(cfg, build_task(cfg.task))
    # instance 0: both right; 1: one right; 2: none
    answers = {
        insts[0].prompt: [str(insts[0].answer)] * 2,
        insts[1].prompt: [str(insts[1].answer), "no idea"],
        insts[2].prompt: ["1000", "2000"],
    }
    started = []

    async def fake_start(engine_cfg, model_path, log_dir="logs", policy_version=0):
        started.append(model_path)
        return CannedPolicy(ChatMLCodec(train_local_chatml_tokenizer()), answers)

    monkeypatch.setattr(engines, "start_engine", fake_start)
    out = tmp_path / "res" / "eval.json"
    rc = cli.main(["eval", str(config), *OVERRIDES, f"run.output_dir={tmp_path}",
                   "--checkpoint", str(checkpoint), "--out", str(out), "--no-wandb"])  # fmt: skip
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert started == [checkpoint]
    assert "pass@1" in printed and "pass@2" in printed and "3 instances x 2 samples" in printed
    data = json.loads(out.read_text())
    assert data["num_instances"] == 3 and data["num_failed"] == 0 and data["k"] == 2
    assert data["scores"]["pass@1"]["mean"] == pytest.approx((1 + 0.5 + 0) / 3)
    assert data["scores"]["pass@2"]["mean"] == pytest.approx((1 + 1 + 0) / 3)
    assert [i["num_correct"] for i in data["instances"]] == [2, 1, 0]
    assert data["checkpoint"] == str(checkpoint) and data["task"] == "arithmetic"
    assert json.loads(printed.strip().splitlines()[-1])["num_instances"] == 3


def _eval(args, capsys) -> tuple[int, str]:
    rc = cli.main(["eval", "configs/eval_arithmetic.yaml", *args])
    return rc, capsys.readouterr().err.strip()


def test_missing_checkpoint(tmp_path, no_engine, capsys):
    rc, err = _eval([*OVERRIDES, "--checkpoint", str(tmp_path / "nope")], capsys)
    assert rc == 2 and len(err.splitlines()) == 1
    assert err == f"megathunder eval: --checkpoint {tmp_path / 'nope'}: no such directory"


def test_checkpoint_without_hf_config(tmp_path, no_engine, capsys):
    (tmp_path / "tokenizer.json").write_text("{}")
    rc, err = _eval([*OVERRIDES, "--checkpoint", str(tmp_path)], capsys)
    assert rc == 2 and "no config.json (expected a Hugging Face model directory)" in err
    assert len(err.splitlines()) == 1


def _tb1_task(root, name, instruction="do it"):
    d = root / name
    (d / "tests").mkdir(parents=True)
    (d / "task.yaml").write_text(json.dumps({"instruction": instruction}))  # JSON is YAML
    (d / "Dockerfile").write_text("FROM megathunder/base\n")
    (d / "run-tests.sh").write_text("true\n")
    return d


def test_malformed_task_records(tmp_path, checkpoint, no_engine, capsys):
    tasks = tmp_path / "tasks"
    bad = _tb1_task(tasks, "t2")
    (bad / "task.yaml").write_text("author_email: a@b\n")
    args = ["task.name=terminal_bench", f"task.path={tasks}", "sandbox.backend=docker",
            "eval.split=all", "eval.num_instances=1", "--checkpoint", str(checkpoint)]  # fmt: skip
    rc, err = _eval(args, capsys)
    assert rc == 2 and err.startswith(f"megathunder eval: {tasks}: no valid task")
    assert f"{bad / 'task.yaml'}: field 'instruction' must be a non-empty string" in err


def test_fewer_instances_than_asked(tmp_path, checkpoint, no_engine, capsys):
    tasks = tmp_path / "tasks"
    for i in range(3):
        _tb1_task(tasks, f"t{i}", f"goal {i}")
    args = ["task.name=terminal_bench", f"task.path={tasks}", "sandbox.backend=docker",
            "eval.split=all", "eval.num_instances=5", "--checkpoint", str(checkpoint)]  # fmt: skip
    rc, err = _eval(args, capsys)
    assert rc == 2 and "has only 3 distinct instances" in err and "5 asked for" in err


def test_bad_eval_config(checkpoint, no_engine, capsys):
    rc, err = _eval(["eval.k=0", "--checkpoint", str(checkpoint)], capsys)
    assert rc == 2 and "eval.k" in err


def test_wandb_offline_when_importable(tmp_path, config, checkpoint, monkeypatch, capsys):
    """With wandb importable (a recording stand-in here; wandb is not a dependency), the metrics
    go to an offline run; without it, nothing is attempted."""
    import sys
    import types

    import megathunder.rollout.engines as engines
    from megathunder.rollout.chat import ChatMLCodec

    calls = {}

    class Run:
        dir = str(tmp_path / "wandb-run")

        def log(self, metrics):
            calls["log"] = metrics

        def finish(self):
            calls["finished"] = True

    def init(**kw):
        calls["init"] = kw
        return Run()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    cfg = load_config(config, OVERRIDES)
    insts = eval_instances(cfg, build_task(cfg.task))

    async def fake_start(*a, **kw):
        return CannedPolicy(ChatMLCodec(train_local_chatml_tokenizer()),
                            {i.prompt: [str(i.answer), "x"] for i in insts})  # fmt: skip

    monkeypatch.setattr(engines, "start_engine", fake_start)
    rc = cli.main(["eval", str(config), *OVERRIDES, f"run.output_dir={tmp_path}",
                   "--checkpoint", str(checkpoint)])  # fmt: skip
    assert rc == 0 and calls["init"]["mode"] == "offline" and calls["finished"]
    assert calls["log"]["eval/pass@1"] == pytest.approx(0.5) and calls["log"]["eval/pass@2"] == 1.0
    assert "wandb (offline)" in capsys.readouterr().out
    assert (tmp_path / "eval.json").is_file()  # default path: run.output_dir/eval.json

    calls.clear()
    rc = cli.main(["eval", str(config), *OVERRIDES, f"run.output_dir={tmp_path}", "run.wandb=disabled",
                   "--checkpoint", str(checkpoint)])  # fmt: skip
    assert rc == 0 and calls == {}

    monkeypatch.setitem(sys.modules, "wandb", None)  # import fails: skipped silently
    calls.clear()
    rc = cli.main(["eval", str(config), *OVERRIDES, f"run.output_dir={tmp_path}",
                   "--checkpoint", str(checkpoint)])  # fmt: skip
    assert rc == 0 and calls == {} and "wandb (offline)" not in capsys.readouterr().out
