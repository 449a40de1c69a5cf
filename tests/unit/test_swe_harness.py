"""Classic SWE-bench and SWE-smith records through their own harnesses' code, in the harness
environment (swebench 4.x and swesmith, which cannot be installed beside swebench 5.x): conversion to
the 5.x form, byte for byte what the harness generates, and SWE-smith grading by its profiles.

Needs the harness environment (``megathunder tasks setup-harness``): skipped without it, except
under tools/test.sh (MEGATHUNDER_REQUIRE_SWE_HARNESS=1), which makes it, where its absence fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap

import pytest

from megathunder.cli import main
from megathunder.rollout.tasks import grading
from megathunder.rollout.tasks.datasets import DatasetError, load_swe_bench, load_swe_smith, swe_bench_image
from megathunder.rollout.tasks.swe_harness import HarnessError, HarnessWorker, harness_python
from tests.swe_records import VERIFIED_REPOS, classic_record, smith_record

@pytest.fixture(scope="module")
def harness() -> str:
    try:
        return harness_python()
    except HarnessError as err:
        if os.environ.get("MEGATHUNDER_REQUIRE_SWE_HARNESS") == "1":
            pytest.fail(str(err))
        pytest.skip(str(err))


def _in_harness(python: str, code: str, payload: object) -> object:
    """Run ``code`` (reads ``payload`` from stdin as JSON, prints JSON) with the harness's Python."""
    proc = subprocess.run([python, "-c", textwrap.dedent(code)], input=json.dumps(payload), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


# The reference: swebench 4.x's make_test_spec itself, untouched, with only the network stubbed (its
# environment-image script fetches requirements files from GitHub, unreachable here).
REFERENCE = """
    import json, sys
    import requests
    class Offline:
        status_code, text = 200, "pytest\\n"
    requests.get = lambda *a, **k: Offline()
    from swebench.harness.test_spec.test_spec import make_test_spec
    from swebench.harness.log_parsers import MAP_REPO_TO_PARSER
    out = {}
    for rec in json.load(sys.stdin):
        spec = make_test_spec(rec, namespace="swebench")
        out[rec["instance_id"]] = [spec.eval_script, spec.instance_image_key, MAP_REPO_TO_PARSER[rec["repo"]].__name__]
    print(json.dumps(out))
"""


def test_classic_verified_records_convert_to_the_harness_s_own_eval_scripts(harness, tmp_path, capsys):
    """One classic record per repository of SWE-bench Verified, converted by `megathunder tasks
    convert-swe` and loaded: each eval script is byte for byte the one swebench 4.x's
    make_test_spec generates for the record, with its instance image and the repository's parser."""
    records = [classic_record(repo, 90001 + k) for k, repo in enumerate(VERIFIED_REPOS)]
    classic, out = tmp_path / "verified.jsonl", tmp_path / "verified_5x.jsonl"
    classic.write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(DatasetError, match="a classic SWE-bench record"):
        load_swe_bench(classic)
    assert main(["tasks", "convert-swe", str(classic), str(out), "--harness-python", harness]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["records"] == 12
    converted = [json.loads(line) for line in out.read_text().splitlines()]
    reference = _in_harness(harness, REFERENCE, records)
    assert isinstance(reference, dict)
    for rec in converted:
        script, image, parser = reference[rec["instance_id"]]
        assert rec["eval_script"] == script, rec["repo"]  # byte for byte
        assert rec["image"] == image == swe_bench_image(rec["instance_id"])
        assert rec["log_parser"] == parser and rec["eval_type"] == "pass_and_fail"
        assert {k: rec[k] for k in records[0]} == next(r for r in records if r["instance_id"] == rec["instance_id"])
    insts = {i.metadata["repo"]: i for i in load_swe_bench(out)}
    assert len(insts) == 12 and all(i.environment.workdir == "/testbed" for i in insts.values())
    django, sympy, sphinx = (insts[r].metadata["eval_script"] for r in ("django/django", "sympy/sympy", "sphinx-doc/sphinx"))
    # what the assembled guess lacked: the testbed environment, each repository's own command
    for script in (django, sympy, sphinx):
        assert "source /opt/miniconda3/bin/activate\nconda activate testbed\ncd /testbed" in script
        assert script.index("SWEBENCH_TEST_EXIT_CODE=$?") < script.index(">>>>> End Test Output")
    assert "./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1 utils_tests.test_text" in django
    assert "bin/test -C --verbose sympy/core/tests/test_numbers.py" in sympy and "tox --current-env" in sphinx
    assert all(grading.check_log_parser(i.metadata["log_parser"]) for i in insts.values())  # 5.x grades them


def test_records_the_harness_does_not_know_are_refused_by_name(harness, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(classic_record("django/django")) + "\n"
                   + json.dumps({**classic_record("pallets/flask"), "version": "0.1"}) + "\n")
    assert main(["tasks", "convert-swe", str(bad), str(tmp_path / "o.jsonl"), "--harness-python", harness]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:2: " in err and "version '0.1' of pallets/flask is not in the swebench 4.x specs" in err
    assert not (tmp_path / "o.jsonl").exists()
    assert main(["tasks", "convert-swe", str(bad), str(tmp_path / "o.jsonl"), "--harness-python",
                 str(tmp_path / "nope")]) == 2
    assert "make it with `megathunder tasks setup-harness`" in capsys.readouterr().err


PROFILE = """
    import json, sys
    from swesmith.profiles import registry
    out = {}
    for rec in json.load(sys.stdin):
        p = registry.get_from_inst(rec)
        out[rec["instance_id"]] = [p.get_test_cmd(rec)[0], p.image_name]
    print(json.dumps(out))
"""


def test_swe_smith_records_take_their_profile_s_command_image_and_parser(harness, tmp_path):
    """SWE-smith records converted through the swesmith package's profiles: the eval script runs
    the profile's test command in /testbed between the markers, in the profile's image; grading
    is the profile's own log parser (autograd's reads pytest-xdist's `[gw0] PASSED x` lines, which
    the default pytest parser does not) and SWE-smith's report."""
    f2p, p2p = ["tests/test_core.py::test_new"], ["tests/test_core.py::test_old"]
    records = [smith_record("mewwts__addict.75284f95", "func_pm_op_swap__x1", f2p, p2p),
               smith_record("HIPS__autograd.ac044f0d", "lm_rewrite__y2", f2p, p2p)]
    five = {**classic_record("pallets/flask"), "image": "reg/flask:1", "log_parser": "parse_log_pytest",
            "eval_type": "pass_and_fail", "eval_script": "#!/bin/bash\n: '>>>>> Start Test Output'\npytest -rA\n"}
    raw, out = tmp_path / "smith.jsonl", tmp_path / "smith_5x.jsonl"
    raw.write_text("".join(json.dumps(r) + "\n" for r in [*records, five]))
    with pytest.raises(DatasetError, match="a SWE-smith record not yet converted"):
        load_swe_smith(raw)
    assert main(["tasks", "convert-swe", str(raw), str(out), "--harness-python", harness]) == 0
    *converted, copied = (json.loads(line) for line in out.read_text().splitlines())
    assert copied == five  # a 5.x record is run as written: converting it changes nothing
    out.write_text("".join(json.dumps(r) + "\n" for r in converted))
    profiles = _in_harness(harness, PROFILE, records)
    assert isinstance(profiles, dict)
    insts = load_swe_smith(out)
    for inst, rec in zip(insts, converted, strict=True):
        command, image = profiles[inst.instance_id]
        assert command.startswith("source /opt/miniconda3/bin/activate; conda activate testbed; pytest")
        assert f"cd /testbed\n: '>>>>> Start Test Output'\n{command}\n: '>>>>> End Test Output'" in rec["eval_script"]
        assert inst.image == image and rec["log_parser"] == "swesmith" and rec["eval_test_files"] == ["tests/test_core.py"]
    worker = HarnessWorker(harness)
    try:
        def grade(inst, lines: str) -> dict:
            log = f"+ : '>>>>> Start Test Output'\n{lines}\n+ : '>>>>> End Test Output'\n"
            return worker.call({"op": "grade_swesmith", "record": inst.metadata["record"], "log": log})

        addict, autograd = insts
        verbose = "tests/test_core.py::test_new PASSED [ 50%]\ntests/test_core.py::test_old PASSED [100%]"
        xdist = "[gw0] PASSED tests/test_core.py::test_new \n[gw1] PASSED tests/test_core.py::test_old "
        assert grade(addict, verbose)["resolved"] and not grade(addict, xdist)["resolved"]
        assert grade(autograd, xdist)["resolved"] and not grade(autograd, verbose)["resolved"]
        failing = grade(autograd, xdist.replace("PASSED tests/test_core.py::test_new", "FAILED tests/test_core.py::test_new"))
        assert not failing["resolved"] and failing["tests_status"]["FAIL_TO_PASS"]["failure"] == f2p
        assert grade(addict, "")["resolved"] is False
    finally:
        worker.close()
