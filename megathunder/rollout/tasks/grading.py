"""SWE-bench grading as the harness does it: an eval script, the test log, its parser, the resolved rule.

The harness (the ``swebench`` package, 5.x) grades an instance by running its *eval script* in the
instance's container -- reset the test files, apply the test patch, run the repository's own test
command between the ``>>>>> Start Test Output`` / ``>>>>> End Test Output`` markers, record the
command's exit status -- then mapping the log between the markers to a per-test status
(``PASSED`` / ``FAILED`` / ``SKIPPED`` / ``ERROR`` / ``XFAIL``) with the repository's log parser
(``parse_log_pytest`` for ``pytest -rA``, ``parse_log_django`` for Django's and unittest's
verbose runner, ``parse_log_sympy`` for SymPy's ``bin/test``, ...). An instance is *resolved*
when every FAIL_TO_PASS test passes and every PASS_TO_PASS test still passes (a skipped P2P test
is not a regression; a skipped F2P test is not a fix). SWE-bench 5.x records carry that script
and parser per instance (``eval_script``, ``log_parser``, ``eval_type``); classic records get
theirs from the 4.x harness (``megathunder tasks convert-swe``). Nothing here writes a test
command: a record whose script is not the harness's own is refused when it is loaded.

What comes from the package: the markers, the log parsers (``PARSER_REGISTRY``), the log
validity checks and status map (``get_logs_eval``), the F2P/P2P report
(``get_eval_tests_report``), the resolved rule (``get_resolution_status``) and the signatures of
environment failures (``infra_failure``). Only the package's pure modules are imported:
``swebench/harness/__init__.py`` imports the Docker and Modal runners (and their dependencies
``docker``, ``modal``, ``datasets``), which grading does not need, so :func:`_harness` registers
``swebench.harness`` as a bare namespace before importing its submodules. Install with ``pip
install --no-deps swebench==5.0.2 unidiff`` (``tools/test.sh`` does); without it, loading a
SWE-style task fails with that instruction.

Failures: a test run killed at its time limit raises :class:`TimeoutError`. An *infrastructure*
failure raises :class:`GradingError` (an ``InfrastructureError``: the episode's error under
``verifier.on_infra_failure``, never a reward): the run never reached the test command (no
markers: the script crashed, the sandbox was lost), the test command was not found or could not
run (exit status 127 / 126), or an unresolved log carries one of the harness's environment
signatures (name resolution failed, the container runtime is unreachable; an out-of-memory kill
is left to the tests: a patch can cause one). Everything the harness itself calls unresolved
(the test patch does not apply, tests fail or are missing) is reward 0.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import sys
import tempfile
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from importlib.util import find_spec
from typing import Any

from megathunder.rollout.verifiers import InfrastructureError, Verdict

SWEBENCH_INSTALL = "pip install --no-deps swebench==5.0.2 unidiff"
DEFAULT_LOG_PARSER = "parse_log_pytest"
RUNNER_MISSING = {126: "could not be executed", 127: "was not found"}
"""Exit statuses of a test command that never ran (bash's): an infrastructure failure."""
_NOT_INFRA = {"out_of_memory"}  # an environment signature a patch can cause (an allocation loop)


class GradingError(InfrastructureError):
    """The tests could not be run or graded (not a failing test: that is reward 0)."""


@dataclass(frozen=True)
class Harness:
    constants: types.ModuleType
    grading: types.ModuleType
    parsers: Mapping[str, Any]
    test_spec: type
    infra_failure: types.ModuleType


@cache
def _harness() -> Harness:
    if find_spec("swebench") is None:
        raise GradingError(f"SWE-bench grading needs the swebench package: {SWEBENCH_INSTALL}")
    pkg = importlib.import_module("swebench")  # lazy in 5.x: imports nothing heavy
    if "swebench.harness" not in sys.modules:  # skip its __init__ (docker, modal runners)
        ns = types.ModuleType("swebench.harness")
        ns.__path__ = [os.path.join(os.path.dirname(pkg.__file__ or ""), "harness")]
        sys.modules["swebench.harness"] = ns
    try:
        constants = importlib.import_module("swebench.harness.constants")
        grading = importlib.import_module("swebench.harness.grading")
        parsers = importlib.import_module("swebench.harness.log_parsers").PARSER_REGISTRY
        test_spec = importlib.import_module("swebench.types").TestSpec
        classify = importlib.import_module("swebench.harness.infra_failure")
    except (ImportError, AttributeError) as err:
        raise GradingError(f"the swebench package lacks its 5.x harness ({err}): {SWEBENCH_INSTALL}") from err
    return Harness(constants, grading, parsers, test_spec, classify)


def check_log_parser(name: str) -> str:
    """``name`` if the harness has such a parser, else a :class:`GradingError` listing them."""
    parsers = _harness().parsers
    if name not in parsers:
        python = ", ".join(sorted(p for p in parsers if p.startswith("parse_log_py")))
        raise GradingError(f"unknown log_parser {name!r} (e.g. {python}, parse_log_django, parse_log_sympy)")
    return name


def with_exit_code(script_lines: list[str]) -> list[str]:
    """Record the test command's own exit status right after the end marker (the harness's
    cross-check of a log that claims success while the command failed)."""
    c = _harness().constants
    for k, line in enumerate(script_lines):
        if c.END_TEST_OUTPUT in line:
            return [*script_lines[:k], f"{c.TEST_EXIT_CODE_VAR}=$?", line,
                    f'echo "{c.TEST_EXIT_CODE}: ${c.TEST_EXIT_CODE_VAR}"', *script_lines[k + 1:]]
    return script_lines


def record_eval_script(script: str) -> str:
    """A record's ``eval_script`` with the exit-status line added (as the harness runs it)."""
    body = [ln for ln in script.strip().split("\n") if ln not in ("#!/bin/bash", "set -uxo pipefail")]
    return "\n".join(["#!/bin/bash", "set -uxo pipefail", *with_exit_code(body)]) + "\n"


def test_exit_code(log: str) -> int | None:
    """The test command's own exit status the eval script recorded after the end marker."""
    c = _harness().constants
    found = re.search(rf"^{re.escape(c.TEST_EXIT_CODE)}:\s*(-?\d+)", log, re.M)
    return int(found.group(1)) if found else None


def infrastructure_failure(log: str) -> str | None:
    """Why ``log`` shows the environment failed -- the harness's environment signatures
    (``infra_failure.classify_text``, tier ``environment``, an OOM kill excepted) -- or None."""
    h = _harness().infra_failure
    found = h.classify_text(log)
    if found is None or found[1] != h.TIER_ENVIRONMENT or found[0] in _NOT_INFRA:
        return None
    return found[0]


def apply_patch_fail() -> str:
    """The harness's marker of a patch that did not apply (the run is graded unresolved)."""
    return str(_harness().constants.APPLY_PATCH_FAIL)


def check_ran(log: str) -> None:
    """Raise :class:`GradingError` when the run never reached its tests: no markers (unless the
    test patch did not apply, which the harness grades unresolved), or a test command that was not
    found or could not run."""
    c = _harness().constants
    if c.START_TEST_OUTPUT not in log or c.END_TEST_OUTPUT not in log:
        if c.APPLY_PATCH_FAIL not in log:
            raise GradingError(f"the test run never reached the test command: ...{log[-400:]}")
    code = test_exit_code(log)
    if code in RUNNER_MISSING:
        raise GradingError(f"the test command {RUNNER_MISSING[code]} (exit {code}): ...{log[-400:]}")


def grade(log: str, fail_to_pass: Sequence[str], pass_to_pass: Sequence[str], *,
          log_parser: str = DEFAULT_LOG_PARSER, eval_type: str = "pass_and_fail",
          instance_id: str = "", repo: str = "") -> Verdict:
    """The harness's verdict on one test log: reward 1.0 when resolved (``RESOLVED_FULL``), the
    status of every F2P / P2P test (``MISSING`` when the log has none) and the resolution. Raises
    :class:`GradingError` for a run that never reached its tests or whose environment failed."""
    h = _harness()
    c, g = h.constants, h.grading
    check_ran(log)
    spec = h.test_spec(instance_id=instance_id, image="", eval_script_list=[], repo=repo, version="",
                       FAIL_TO_PASS=list(fail_to_pass), PASS_TO_PASS=list(pass_to_pass),
                       log_parser=check_log_parser(log_parser), eval_type=eval_type)
    with tempfile.NamedTemporaryFile("w", suffix=".log", delete=False) as f:
        f.write(log)
    try:
        status_map, valid = g.get_logs_eval(spec, f.name)
    finally:
        os.unlink(f.name)
    gold = {c.FAIL_TO_PASS: list(fail_to_pass), c.PASS_TO_PASS: list(pass_to_pass)}
    report = g.get_eval_tests_report(status_map, gold, eval_type=c.EvalType(eval_type))
    resolution = g.get_resolution_status(report) if valid else c.ResolvedStatus.NO.value
    resolved = valid and resolution == c.ResolvedStatus.FULL.value
    if not resolved and (why := infrastructure_failure(log)) is not None:
        raise GradingError(f"the test environment failed ({why}): ...{log[-400:]}")
    tests = {t: status_map.get(t, "MISSING") for t in [*fail_to_pass, *pass_to_pass]}
    summary = {k: {"success": len(report[k]["success"]), "failure": len(report[k]["failure"])}
               for k in (c.FAIL_TO_PASS, c.PASS_TO_PASS)}
    detail = {"resolution": resolution, "log_valid": valid, **summary}
    return Verdict(float(resolved), tests=tests, detail=json.dumps(detail))
