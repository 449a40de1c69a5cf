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
and parser per instance (``eval_script``, ``log_parser``, ``eval_type``); for a record without
one, :func:`eval_script` assembles the same shape from its ``test_patch`` and ``test_command``.

What comes from the package: the markers, the log parsers (``PARSER_REGISTRY``), the log
validity checks and status map (``get_logs_eval``), the F2P/P2P report
(``get_eval_tests_report``) and the resolved rule (``get_resolution_status``). Only the package's
pure modules are imported: ``swebench/harness/__init__.py`` imports the Docker and Modal runners
(and their dependencies ``docker``, ``modal``, ``datasets``), which grading does not need, so
:func:`_harness` registers ``swebench.harness`` as a bare namespace before importing its
submodules. Install with ``pip install --no-deps swebench==5.0.2 unidiff`` (``tools/test.sh``
does); without it, loading a SWE-style task fails with that instruction.

Failures: a test run killed at its time limit raises :class:`TimeoutError` and a run that never
reached the test command (no markers: the script crashed) raises :class:`GradingError`, so both
get the verifier pool's failure policy (``verifier.on_failure``). Everything the harness itself
calls unresolved (the test patch does not apply, tests fail or are missing) is reward 0.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import tempfile
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from importlib.util import find_spec
from typing import Any

from megathunder.rollout.verifiers import Verdict

SWEBENCH_INSTALL = "pip install --no-deps swebench==5.0.2 unidiff"
DEFAULT_LOG_PARSER = "parse_log_pytest"
LOG_PARSERS_BY_REPO = {"django/django": "parse_log_django", "sympy/sympy": "parse_log_sympy"}
"""The parser of a classic SWE-bench record without ``log_parser`` (as the 4.x harness mapped
them); every other Python repository's harness command is ``pytest -rA``."""


class GradingError(RuntimeError):
    """The tests could not be run or graded (not a failing test: that is reward 0)."""


@dataclass(frozen=True)
class Harness:
    constants: types.ModuleType
    grading: types.ModuleType
    parsers: Mapping[str, Any]
    test_spec: type


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
    except (ImportError, AttributeError) as err:
        raise GradingError(f"the swebench package lacks its 5.x harness ({err}): {SWEBENCH_INSTALL}") from err
    return Harness(constants, grading, parsers, test_spec)


def check_log_parser(name: str) -> str:
    """``name`` if the harness has such a parser, else a :class:`GradingError` listing them."""
    parsers = _harness().parsers
    if name not in parsers:
        python = ", ".join(sorted(p for p in parsers if p.startswith("parse_log_py")))
        raise GradingError(f"unknown log_parser {name!r} (e.g. {python}, parse_log_django, parse_log_sympy)")
    return name


def eval_script(test_command: str, test_patch: str = "", *, reset_files: Sequence[str] = (),
                reset_to: str | None = None, repo_dir: str | None = None) -> str:
    """An eval script in the harness's shape: ``cd`` to the repository, restore ``reset_files``
    (the test files the test patch touches, which the agent may have edited) to ``reset_to``
    (default ``HEAD``), apply ``test_patch``, run ``test_command`` between the markers and
    record its exit status after the end marker."""
    c = _harness().constants
    lines = ["#!/bin/bash", "set -uxo pipefail"]
    if repo_dir:
        lines.append(f"cd {repo_dir}")
    if reset_files:
        # a file the test patch creates is not in the commit: remove it (the patch adds it back)
        lines += [f"git checkout -q {reset_to or 'HEAD'} -- {f} 2>/dev/null || rm -f {f}" for f in reset_files]
    if test_patch:
        delim = "EOF_MEGATHUNDER_TEST_PATCH"
        if delim in test_patch:
            raise GradingError(f"the test patch contains the heredoc delimiter {delim}")
        lines += [f"git apply -v - <<'{delim}' || echo '{c.APPLY_PATCH_FAIL}'", test_patch.rstrip("\n"), delim]
    return "\n".join(lines + with_exit_code([f"echo '{c.START_TEST_OUTPUT}'", test_command,
                                             f"echo '{c.END_TEST_OUTPUT}'"])) + "\n"


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


def grade(log: str, fail_to_pass: Sequence[str], pass_to_pass: Sequence[str], *,
          log_parser: str = DEFAULT_LOG_PARSER, eval_type: str = "pass_and_fail",
          instance_id: str = "", repo: str = "") -> Verdict:
    """The harness's verdict on one test log: reward 1.0 when resolved (``RESOLVED_FULL``), the
    status of every F2P / P2P test (``MISSING`` when the log has none) and the resolution."""
    h = _harness()
    c, g = h.constants, h.grading
    if c.START_TEST_OUTPUT not in log or c.END_TEST_OUTPUT not in log:
        if c.APPLY_PATCH_FAIL not in log:
            raise GradingError(f"the test run never reached the test command: ...{log[-400:]}")
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
    tests = {t: status_map.get(t, "MISSING") for t in [*fail_to_pass, *pass_to_pass]}
    summary = {k: {"success": len(report[k]["success"]), "failure": len(report[k]["failure"])}
               for k in (c.FAIL_TO_PASS, c.PASS_TO_PASS)}
    detail = {"resolution": resolution, "log_valid": valid, **summary}
    return Verdict(float(valid and resolution == c.ResolvedStatus.FULL.value), tests=tests, detail=json.dumps(detail))
