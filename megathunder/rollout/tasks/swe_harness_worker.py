"""The SWE harnesses' own code, run in the harness environment (``megathunder tasks setup-harness``).

This file is run as a script by that environment's Python (``swebench`` 4.x and ``swesmith``,
which pins the 4.x harness: neither installs beside the ``swebench`` 5.x that grades SWE-bench
records here). It imports nothing of ``megathunder`` and only the standard library at the top.
Requests come as JSON lines on stdin, answers go as JSON lines to stdout (``{"ok": true,
"result": ...}`` or ``{"ok": false, "error": "..."}``), one per request, in order:

- ``{"op": "convert", "record": R, "namespace": "swebench"}``: the 5.x form of a classic record.
  A SWE-bench record (its repository and version in the 4.x harness's specs) gets the eval script
  ``make_test_spec`` generates for it, its instance image name and its repository's log parser; a
  SWE-smith record (its repository a ``swesmith`` profile) gets the eval script SWE-smith's
  harness writes (its profile's test command between the markers, run in ``/testbed``), the
  profile's image, ``log_parser: "swesmith"`` and the test files the harness reverts before a run.
- ``{"op": "grade_swesmith", "record": R, "log": L}``: SWE-smith's own report on a test log
  (``swesmith.harness.grading.get_eval_report``: the profile's log parser, its F2P / P2P report).
- ``{"op": "versions"}``: the installed harness versions.

``make_test_spec`` also builds the environment image's set-up script, which downloads the
repository's requirements from GitHub; an eval script does not depend on it, so conversion
replaces that one step with an empty list (the eval script is the harness's, byte for byte).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import tempfile
from typing import Any

SWESMITH_PARSER = "swesmith"


def _json_list(value: Any) -> list:
    return json.loads(value) if isinstance(value, str) else list(value or [])


def _smith_profile(record: dict) -> Any:
    registry = importlib.import_module("swesmith.profiles").registry
    key = record.get("repo") or record["instance_id"].rsplit(".", 1)[0]
    if key not in registry.keys():
        return None
    return registry.get(key)


def convert(record: dict, namespace: str = "swebench") -> dict:
    if record.get("eval_script"):
        return record  # the 5.x form already: run as written
    profile = _smith_profile(record)
    if profile is not None:
        return _convert_smith(record, profile)
    specs = importlib.import_module("swebench.harness.constants").MAP_REPO_VERSION_TO_SPECS
    repo, version = record.get("repo"), record.get("version")
    if repo not in specs:
        raise ValueError(f"repo {repo!r} is neither a SWE-bench repository (swebench 4.x specs) nor a SWE-smith profile")
    if str(version) not in specs[repo]:
        raise ValueError(f"version {version!r} of {repo} is not in the swebench 4.x specs ({', '.join(sorted(specs[repo]))})")
    ts = importlib.import_module("swebench.harness.test_spec.test_spec")
    setattr(ts, "make_env_script_list", lambda instance, specs, env_name: [])  # the image's set-up script (above)
    spec = ts.make_test_spec({**record, "version": str(version)}, namespace=namespace)
    parsers = importlib.import_module("swebench.harness.log_parsers").MAP_REPO_TO_PARSER
    fail_only = importlib.import_module("swebench.harness.constants").FAIL_ONLY_REPOS
    return {**record, "version": str(version), "image": spec.instance_image_key, "eval_script": spec.eval_script,
            "log_parser": parsers[repo].__name__, "eval_type": "fail_only" if repo in fail_only else "pass_and_fail"}


def _convert_smith(record: dict, profile: Any) -> dict:
    constants = importlib.import_module("swesmith.constants")
    workdir = importlib.import_module("swebench.harness.constants").DOCKER_WORKDIR
    inst = {**record, "FAIL_TO_PASS": _json_list(record.get("FAIL_TO_PASS")),
            "PASS_TO_PASS": _json_list(record.get("PASS_TO_PASS"))}
    test_cmd, _ = profile.get_test_cmd(inst)
    f2p_files, p2p_files = profile.get_test_files(inst)
    # the eval script SWE-smith's harness writes (swesmith.harness.utils.run_patch_in_container)
    script = "\n".join(["#!/bin/bash", "set -uxo pipefail", f"cd {workdir}", f": '{constants.TEST_OUTPUT_START}'",
                        test_cmd, f": '{constants.TEST_OUTPUT_END}'"]) + "\n"
    return {**record, "image": profile.image_name, "eval_script": script, "log_parser": SWESMITH_PARSER,
            "eval_type": "pass_and_fail", "eval_test_files": list(dict.fromkeys([*f2p_files, *p2p_files]))}


def grade_swesmith(record: dict, log: str) -> dict:
    grading = importlib.import_module("swesmith.harness.grading")
    key = importlib.import_module("swebench.harness.constants").KEY_PREDICTION
    inst = {**record, "FAIL_TO_PASS": _json_list(record.get("FAIL_TO_PASS")),
            "PASS_TO_PASS": _json_list(record.get("PASS_TO_PASS"))}
    with tempfile.NamedTemporaryFile("w", suffix=".log", delete=False) as f:
        f.write(log)
    try:
        report = grading.get_eval_report({key: "(the episode's changes)", "instance_id": inst["instance_id"]},
                                         inst, f.name)
    finally:
        os.unlink(f.name)
    return {"resolved": bool(report.get("resolved")), "tests_status": report.get("tests_status")}


def versions() -> dict:
    from importlib.metadata import version

    return {name: version(name) for name in ("swebench", "swesmith")}


def handle(request: dict) -> Any:
    op = request.get("op")
    if op == "convert":
        return convert(request["record"], request.get("namespace", "swebench"))
    if op == "grade_swesmith":
        return grade_swesmith(request["record"], request["log"])
    if op == "versions":
        return versions()
    raise ValueError(f"unknown op {op!r}")


def main() -> int:
    out = sys.stdout
    sys.stdout = sys.stderr  # the harnesses' own prints must not reach the answers
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            answer = {"ok": True, "result": handle(json.loads(line))}
        except Exception as err:  # one bad record is an answer, not the end of the worker
            answer = {"ok": False, "error": f"{type(err).__name__}: {err}"}
        out.write(json.dumps(answer) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
