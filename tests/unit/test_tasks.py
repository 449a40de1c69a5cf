"""Bundled tasks with correct and wrong scripted answers, and the dataset loaders' errors."""

from __future__ import annotations

import json

import pytest

from pydantic import TypeAdapter

from megathunder.config import GeneratedTaskConfig, TaskConfig
from megathunder.rollout.tools import safe_eval
from megathunder.rollout.tasks import build_task
from megathunder.rollout.tasks.task import tool_call_text
from megathunder.rollout.tasks.datasets import (
    DatasetError,
    load_swe_bench,
    load_swe_smith,
    swe_bench_image,
)
from tests.rollout_helpers import needs_root, run_scripted


@pytest.mark.parametrize(
    "name", ["arithmetic", "calculator", pytest.param("terminal", marks=needs_root)]
)
def test_bundled_task_scripted_solutions_score_one(name, tmp_path):
    task = build_task(TypeAdapter(TaskConfig).validate_python({"name": name}))
    insts = task.instances(3, seed=5)
    episodes, _ = run_scripted(task, insts, tmp_path)
    assert [ep.reward.reward for ep in episodes] == [1.0, 1.0, 1.0]
    wrong = {
        i.prompt: [tool_call_text("bash", command="true")] * (name == "terminal") + ["12345"]
        for i in insts
    }
    episodes, _ = run_scripted(task, insts, tmp_path, scripts=wrong)
    assert [ep.reward.reward for ep in episodes] == [0.0, 0.0, 0.0]


def test_calculator_is_multi_turn_and_rejects_code():
    task = build_task(GeneratedTaskConfig(name="calculator"))
    inst = task.instances(1, seed=0)[0]
    assert len(task.scripted_turns(inst)) == 4
    assert safe_eval("(3 + 4) * 5 - 2 ** 3") == 27
    for bad in ("__import__('os')", "2 ** 1000", "[1] * 3", "a + 1"):
        with pytest.raises((ValueError, SyntaxError)):
            safe_eval(bad)


def test_instances_are_reproducible_and_distinct():
    for name in ("arithmetic", "calculator", "swe_local", "terminal"):
        task = build_task(TypeAdapter(TaskConfig).validate_python({"name": name}))
        a, b = task.instances(6, seed=1), task.instances(6, seed=1)
        assert a == b and len({i.prompt for i in a}) == 6  # the scripted policy keys on the prompt
        assert [i.prompt for i in task.instances(6, seed=2)] != [i.prompt for i in a]


SWE_BENCH = {  # the classic form (SWE-bench Verified as first released): no eval script
    "instance_id": "astropy__astropy-90001",
    "repo": "astropy/astropy",
    "base_commit": "d16bfe05a744909de4b27f5875fe0d4ed41ce607",
    "problem_statement": "separability_matrix is wrong for nested models",
    "test_patch": "diff --git a/x b/x\n",
    "version": "4.3",
    "FAIL_TO_PASS": json.dumps(
        ["astropy/modeling/tests/test_separable.py::test_separable[compound_model6]"]
    ),
    "PASS_TO_PASS": json.dumps(["astropy/modeling/tests/test_separable.py::test_coord_matrix"]),
}
SWE_BENCH_5 = {  # the 5.x form: the harness's eval script, image and parser in the record
    **SWE_BENCH, "image": "swebench/sweb.eval.x86_64.astropy_1776_astropy-90001:latest",
    "eval_script": "#!/bin/bash\nset -uxo pipefail\ncd /testbed\n: '>>>>> Start Test Output'\npytest -rA x\n"
                   ": '>>>>> End Test Output'\n",
    "log_parser": "parse_log_pytest_v2", "eval_type": "pass_and_fail",
}  # fmt: skip


def _jsonl(tmp_path, records, name="data.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
    return path


def test_swe_bench_5_records_jsonl_and_parquet(tmp_path):
    (inst,) = load_swe_bench(_jsonl(tmp_path, [SWE_BENCH_5]))
    assert inst.image == SWE_BENCH_5["image"] and inst.environment.workdir == "/testbed"
    assert inst.metadata["fail_to_pass"] == [
        "astropy/modeling/tests/test_separable.py::test_separable[compound_model6]"
    ]
    script = inst.metadata["eval_script"]  # as written, with the exit status recorded (as the harness runs it)
    assert script.startswith(SWE_BENCH_5["eval_script"].split(": '>>>>> End")[0]) and "SWEBENCH_TEST_EXIT_CODE=$?" in script
    assert inst.metadata["log_parser"] == "parse_log_pytest_v2" and inst.prompt.startswith("separability")
    pq = pytest.importorskip("pyarrow.parquet", reason="parquet loading needs pyarrow")
    import pyarrow as pa

    path = tmp_path / "verified.parquet"
    pq.write_table(pa.Table.from_pylist([SWE_BENCH_5, {**SWE_BENCH_5, "instance_id": "django__django-90002"}]), path)
    assert [i.instance_id for i in load_swe_bench(path)] == ["astropy__astropy-90001", "django__django-90002"]
    assert swe_bench_image("django__django-90002") == "swebench/sweb.eval.x86_64.django_1776_django-90002:latest"


def test_classic_records_are_refused_with_the_command_that_converts_them(tmp_path):
    """No test command is guessed: a record without its harness's eval script is refused, naming
    the record and the conversion command (SWE-bench and SWE-smith alike)."""
    path = _jsonl(tmp_path, [SWE_BENCH_5, SWE_BENCH])
    with pytest.raises(DatasetError) as err:
        load_swe_bench(path)
    msg = str(err.value)
    assert msg.startswith(f"{path}:2: a classic SWE-bench record (no field 'eval_script')")
    assert f"megathunder tasks convert-swe {path} OUT.jsonl" in msg
    smith = {**SWE_BENCH, "instance_id": "mewwts__addict.75284f95.lm_1", "repo": "swesmith/mewwts__addict.75284f95",
             "image_name": "jyangballin/swesmith.x86_64.mewwts_1776_addict.75284f95", "patch": "diff --git a/m b/m\n"}
    with pytest.raises(DatasetError, match="a SWE-smith record not yet converted .*`megathunder tasks convert-swe "):
        load_swe_smith(_jsonl(tmp_path, [smith]))
    # a converted SWE-smith record is not a SWE-bench one, and the other way round
    converted = {**smith, **{k: SWE_BENCH_5[k] for k in ("image", "eval_script", "eval_type")}, "log_parser": "swesmith"}
    with pytest.raises(DatasetError, match="a SWE-smith record .*task.name=swe_smith"):
        load_swe_bench(_jsonl(tmp_path, [converted]))
    with pytest.raises(DatasetError, match="field 'log_parser' must be 'swesmith'"):
        load_swe_smith(_jsonl(tmp_path, [SWE_BENCH_5]))


def test_converted_swe_smith_record(tmp_path):
    smith = {**SWE_BENCH, "instance_id": "mewwts__addict.75284f95.lm_1", "repo": "swesmith/mewwts__addict.75284f95",
             "FAIL_TO_PASS": ["t::a"], "PASS_TO_PASS": [], "patch": "diff --git a/m.py b/m.py\n",
             "image": "swebench/swesmith.x86_64.mewwts_1776_addict.75284f95", "log_parser": "swesmith",
             "eval_type": "pass_and_fail", "eval_script": SWE_BENCH_5["eval_script"], "eval_test_files": ["t"]}
    (inst,) = load_swe_smith(_jsonl(tmp_path, [smith]))
    assert inst.image == smith["image"] and inst.metadata["fail_to_pass"] == ["t::a"]
    assert inst.metadata["test_files"] == ["t"] and inst.metadata["harness"] == "swesmith"
    setup = inst.metadata["setup"][0]  # the instance's branch, else its bug patch
    assert "git checkout -q mewwts__addict.75284f95.lm_1" in setup and "git apply" in setup


@pytest.mark.parametrize(
    ("records", "loader", "message"),
    [
        ([SWE_BENCH_5, "{not json"], load_swe_bench, "data.jsonl:2: invalid JSON"),
        (["[1, 2]"], load_swe_bench, "data.jsonl:1: expected a JSON object, got list"),
        (
            [{k: v for k, v in SWE_BENCH_5.items() if k != "image"}],
            load_swe_bench,
            "data.jsonl:1: missing field 'image'",
        ),
        (
            [{**SWE_BENCH_5, "FAIL_TO_PASS": "[oops"}],
            load_swe_bench,
            "data.jsonl:1: field 'FAIL_TO_PASS' is not a JSON list",
        ),
        (
            [{**SWE_BENCH_5, "FAIL_TO_PASS": 3}],
            load_swe_bench,
            "field 'FAIL_TO_PASS' must be a list of strings, got int",
        ),
        (
            [{**SWE_BENCH_5, "problem_statement": "  "}],
            load_swe_bench,
            "field 'problem_statement' is empty",
        ),
        (
            [{**SWE_BENCH_5, "log_parser": "parse_log_nonesuch"}],
            load_swe_bench,
            "data.jsonl:1: field 'log_parser': unknown log_parser 'parse_log_nonesuch'",
        ),
        (
            [{**SWE_BENCH, "repo": "django/django"}],
            load_swe_bench,
            "data.jsonl:1: a classic SWE-bench record (no field 'eval_script')",
        ),
    ],
)
def test_malformed_records_name_file_line_and_field(tmp_path, records, loader, message):
    path = _jsonl(tmp_path, records)
    with pytest.raises(DatasetError) as err:
        loader(path)
    assert message in str(err.value) and str(path) in str(err.value)


def test_missing_or_unknown_files(tmp_path):
    with pytest.raises(DatasetError, match="nope.jsonl: file not found"):
        load_swe_bench(tmp_path / "nope.jsonl")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DatasetError, match="expected a .jsonl or .parquet file"):
        load_swe_bench(tmp_path / "x.csv")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DatasetError, match="no records"):
        load_swe_bench(tmp_path / "empty.jsonl")
    (tmp_path / "bad.parquet").write_text("not parquet")
    pytest.importorskip("pyarrow.parquet", reason="parquet loading needs pyarrow")
    with pytest.raises(DatasetError, match="bad.parquet: not a readable parquet file"):
        load_swe_bench(tmp_path / "bad.parquet")
