"""Loaders for SWE-bench and SWE-smith records from local files, and the SWE task.

Files are JSONL (one JSON object per line) or parquet (the Hugging Face layout; needs pyarrow).
Every error names the file, the record (line number or row) and the field. Every record form
loads and grades as its harness does, or is refused by name; no test command is ever guessed:

- **SWE-bench 5.x records** carry their harness's ``eval_script`` with ``image``, ``log_parser``
  and ``eval_type``: the script runs as written (under bash, in the harness's repository directory
  ``/testbed``, as the container's user) in the record's ``image``, its log is graded by the named
  parser (``grading.py``).
- **Classic SWE-bench records** (no ``eval_script``: SWE-bench Verified as first released and the
  sets derived from it) are refused with the command that converts them: ``megathunder tasks
  convert-swe IN OUT`` writes the 5.x form with the eval script the 4.x harness's
  ``make_test_spec`` generates (``swe_harness.py``).
- **SWE-smith records** are converted by the same command, through the ``swesmith`` package's
  profile of their repository: its test command (in the eval script), its image, and
  ``log_parser: "swesmith"`` -- grading runs the profile's own log parser and report in the
  harness environment (``swe_harness.HarnessWorker``). Unconverted, they are refused likewise.

Set-up and grading, as the harnesses do it:

- SWE-bench: the image holds the repository at ``base_commit`` with its environment; the agent
  works on it as is. The test patch is *not* applied before the episode (the agent never sees
  the new tests): it is part of the eval script that grades the episode.
- SWE-smith: the image holds the unbroken repository; each instance is a branch named by its
  ``instance_id`` carrying the bug, its last commit removing the FAIL_TO_PASS tests (SWE-smith's
  harness checks it out). Set-up checks the branch out when the image has it, else applies the
  record's ``patch`` (the bug, as a diff) -- so the agent always works on the buggy repository,
  and set-up fails clearly if neither works. Grading rebuilds the harness's evaluation state in
  the episode's container: the agent's changes are taken as a diff, the branch's parent (with the
  tests) checked out, the diff applied (``>>>>> Patch Apply Failed`` when it does not: unresolved),
  the record's test files reverted, then the eval script runs.

Oracles (``megathunder tasks check``): the SWE-bench gold ``patch`` applied; for SWE-smith the
bug ``patch`` reverted (SWE-smith's gold patch is the reverse of the bug).
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import shlex
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from megathunder.config import TestRunLimits
from megathunder.rollout.sandbox import Environment, SandboxError
from megathunder.rollout.tasks import grading
from megathunder.rollout.tasks.grading import GradingError
from megathunder.rollout.tasks.swe_harness import SWESMITH_PARSER, HarnessWorker
from megathunder.rollout.tasks.task import DatasetTask, TaskInstance, tool_call_text
from megathunder.rollout.tools import BASH, READ_FILE, STR_REPLACE, WRITE_FILE
from megathunder.rollout.verifiers import Verdict

class DatasetError(ValueError):
    pass


def read_records(path: str | Path) -> list[tuple[str, dict[str, Any]]]:
    """``(where, record)`` pairs, ``where`` being ``file:line`` (JSONL) or ``file row N``."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"{path}: file not found")
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as err:
            raise DatasetError(
                f"{path}: reading parquet needs pyarrow (pip install pyarrow)"
            ) from err
        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as err:
            raise DatasetError(f"{path}: not a readable parquet file ({err})") from err
        return [(f"{path} row {k}", row) for k, row in enumerate(rows)]
    if path.suffix not in (".jsonl", ".json"):
        raise DatasetError(f"{path}: expected a .jsonl or .parquet file")
    out = []
    for num, raw in enumerate(path.read_bytes().split(b"\n"), 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise DatasetError(f"{path}:{num}: not UTF-8 ({err.reason} at byte {err.start})") from None
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise DatasetError(f"{path}:{num}: invalid JSON ({err.msg})") from err
        except RecursionError:
            raise DatasetError(f"{path}:{num}: JSON nested too deeply") from None
        if not isinstance(record, dict):
            raise DatasetError(f"{path}:{num}: expected a JSON object, got {type(record).__name__}")
        out.append((f"{path}:{num}", record))
    if not out:
        raise DatasetError(f"{path}: no records")
    return out


def _field(
    where: str, record: dict, name: str, kind: type[str] | type[list] = str, default: Any = ...
) -> Any:
    if name not in record or record[name] is None:
        if default is not ...:
            return default
        raise DatasetError(f"{where}: missing field {name!r}")
    value = record[name]
    if kind is list and isinstance(value, str):  # SWE-bench stores test lists as JSON strings
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise DatasetError(f"{where}: field {name!r} is not a JSON list ({err.msg})") from err
    if not isinstance(value, kind) or (kind is list and not all(isinstance(v, str) for v in value)):
        want = "a list of strings" if kind is list else kind.__name__
        raise DatasetError(f"{where}: field {name!r} must be {want}, got {type(value).__name__}")
    if isinstance(value, str) and kind is str and not value.strip():
        raise DatasetError(f"{where}: field {name!r} is empty")
    return value


SWE_WORKDIR = "/testbed"
"""The harness's repository directory in SWE-bench and SWE-smith images (swebench's
``CONTAINER_WORKDIR``), where the eval script and the agent run."""
EVAL_NAME, GRADE_NAME = ".megathunder_eval_{}.sh", ".megathunder_grade_{}.sh"
"""Written to the sandbox's ``tmp_dir`` at grading (a container's /tmp; the local sandbox's work
dir), each with a name of its own (``{}``: a random suffix)."""
CONVERT = "megathunder tasks convert-swe"


def swe_bench_image(instance_id: str, namespace: str = "swebench", arch: str = "x86_64") -> str:
    """The SWE-bench harness's instance image name (its docker hub form: '__' -> '_1776_')."""
    return f"{namespace}/sweb.eval.{arch}.{instance_id.lower()}:latest".replace("__", "_1776_")


def patch_files(patch: str) -> list[str]:
    """The files a unified diff touches (its ``diff --git a/X b/X`` headers, else ``+++ b/X``)."""
    files = re.findall(r"^diff --git a/(\S+) b/\S+", patch, re.M) or re.findall(r"^\+\+\+ b/(\S+)", patch, re.M)
    return list(dict.fromkeys(files))


def _unconverted(where: str, path: str | Path, what: str) -> DatasetError:
    return DatasetError(f"{where}: {what} (no field 'eval_script'): the harness's eval script for it is not "
                        f"known here; convert the file with `{CONVERT} {path} OUT.jsonl` (the SWE-bench 4.x "
                        "harness and swesmith, in their own environment), then load OUT.jsonl")


def _instance(where: str, rec: dict, *, smith: bool) -> TaskInstance:
    iid = _field(where, rec, "instance_id")
    f2p, p2p = _field(where, rec, "FAIL_TO_PASS", list), _field(where, rec, "PASS_TO_PASS", list, [])
    parser = _field(where, rec, "log_parser")
    if not smith:
        try:
            grading.check_log_parser(parser)
        except GradingError as err:
            raise DatasetError(f"{where}: field 'log_parser': {err}") from None
    eval_type = _field(where, rec, "eval_type")
    if eval_type not in ("pass_and_fail", "fail_only"):
        raise DatasetError(f"{where}: field 'eval_type' must be pass_and_fail or fail_only, got {eval_type!r}")
    gold = _field(where, rec, "patch", str, "")
    meta: dict[str, Any] = {
        "harness": "swesmith" if smith else "swebench", "repo": _field(where, rec, "repo"),
        "fail_to_pass": f2p, "pass_to_pass": p2p, "log_parser": parser, "eval_type": eval_type,
        "eval_script": grading.record_eval_script(_field(where, rec, "eval_script")), "patch": gold, "setup": [],
    }  # fmt: skip
    if smith:
        meta["setup"] = swe_smith_setup(iid, gold)
        meta["test_files"] = _field(where, rec, "eval_test_files", list, [])
        meta["record"] = {"instance_id": iid, "repo": meta["repo"], "FAIL_TO_PASS": f2p, "PASS_TO_PASS": p2p}
    timeout = rec.get("test_timeout_s")
    return TaskInstance(
        instance_id=iid, prompt=_field(where, rec, "problem_statement"), image=_field(where, rec, "image"),
        environment=Environment(name=iid, workdir=SWE_WORKDIR, network=False),
        test_timeout_s=float(timeout) if isinstance(timeout, (int, float)) and timeout > 0 else None,
        metadata=meta,
    )  # fmt: skip


def load_swe_bench(path: str | Path) -> list[TaskInstance]:
    """SWE-bench records in the 5.x form (their own eval script, image, parser); a classic record
    is refused with the command that converts it."""
    out = []
    for where, rec in read_records(path):
        if rec.get("eval_script") is None:
            raise _unconverted(where, path, "a classic SWE-bench record")
        if rec.get("log_parser") == SWESMITH_PARSER:
            raise DatasetError(f"{where}: field 'log_parser': a SWE-smith record (graded by its profile): "
                               "load it with task.name=swe_smith")
        out.append(_instance(where, rec, smith=False))
    return out


def load_swe_smith(path: str | Path) -> list[TaskInstance]:
    """SWE-smith records converted by ``megathunder tasks convert-swe`` (its profile's eval script,
    image and parser); an unconverted record is refused with that command."""
    out = []
    for where, rec in read_records(path):
        if rec.get("eval_script") is None:
            raise _unconverted(where, path, "a SWE-smith record not yet converted")
        if rec.get("log_parser") != SWESMITH_PARSER:
            raise DatasetError(f"{where}: field 'log_parser' must be {SWESMITH_PARSER!r} (a converted SWE-smith "
                               f"record), got {rec.get('log_parser')!r}: a SWE-bench record loads with task.name=swe_bench")
        out.append(_instance(where, rec, smith=True))
    return out


def swe_smith_setup(instance_id: str, patch: str) -> list[str]:
    """SWE-smith's instance set-up: check out the instance's branch, or apply its bug ``patch``."""
    branch = shlex.quote(instance_id)
    missing = f"echo 'no branch {branch} in the repository, and the record has no patch' >&2; false"
    apply = f"git apply - <<'EOF_MEGATHUNDER_BUG'\n{patch.rstrip()}\nEOF_MEGATHUNDER_BUG" if patch else missing
    return [f"if git rev-parse -q --verify refs/heads/{branch} >/dev/null; then git checkout -q {branch}\n"
            f"else {apply}\nfi"]


def swe_smith_grade_script(instance_id: str, test_files: Sequence[str], eval_path: str) -> str:
    """SWE-smith's evaluation state, rebuilt in the episode's container before the eval script
    (``eval_path``): on the instance's branch, its parent (which has the FAIL_TO_PASS tests) with the
    agent's changes applied; then the record's test files reverted (the harness's order). Our own
    ``.megathunder_*`` files are neither part of the changes nor cleaned away."""
    apply_fail = grading.apply_patch_fail()
    files = " ".join(shlex.quote(f) for f in test_files)
    return "\n".join([
        "#!/bin/bash", "set -uo pipefail", f"AGENT={eval_path.rpartition('/')[0]}/.megathunder_agent.patch",
        "git add -A -- . ':!.megathunder_*' && git diff --cached --binary HEAD > \"$AGENT\"; git reset -q",
        f"if [ \"$(git rev-parse --abbrev-ref HEAD)\" = {shlex.quote(instance_id)} ]; then",
        "  git checkout -q -f HEAD~1 && git clean -fdq -e '.megathunder_*'",
        f'  if [ -s "$AGENT" ] && ! git apply --binary "$AGENT"; then echo \'{apply_fail}\'; fi',
        "fi",
        f'for f in {files}; do git checkout -q HEAD -- "$f" 2>/dev/null; done' if files else ":",
        f"bash {eval_path}",
    ]) + "\n"  # fmt: skip


class SweTask(DatasetTask):
    """SWE-bench / SWE-smith instances; reward = resolved, graded as the harness does."""

    system_prompt = (
        "You are a software engineer working in a repository. Reply without a tool call when done."
    )
    tools = (BASH, READ_FILE, WRITE_FILE, STR_REPLACE)

    def __init__(self, name: str, instances: Sequence[TaskInstance], test_run: TestRunLimits | None = None,
                 harness_python: str | None = None) -> None:
        if not instances:
            raise DatasetError(f"task {name}: no instances")
        super().__init__(instances, test_run)
        self.name = name
        self._harness: HarnessWorker | None = None
        self._harness_python = harness_python

    async def setup(self, inst, sandbox) -> None:
        await super().setup(inst, sandbox)
        for command in inst.metadata["setup"]:
            done = await sandbox.shell(command)
            if not done.ok:
                raise SandboxError(f"instance {inst.instance_id}: set-up failed: {done.observation()[-500:]}")

    async def verify(self, inst, episode, sandbox) -> Verdict:
        meta = inst.metadata
        smith = meta["harness"] == "swesmith"
        suffix = secrets.token_hex(4)
        eval_path, grade_path = (f"{sandbox.tmp_dir}/{name.format(suffix)}" for name in (EVAL_NAME, GRADE_NAME))
        script = eval_path
        for path, text in ((eval_path, meta["eval_script"]),
                           *([(grade_path, swe_smith_grade_script(inst.instance_id, meta["test_files"], eval_path))]
                             if smith else [])):
            written = await sandbox.write_file(path, text)
            if not written.ok:
                raise SandboxError(f"instance {inst.instance_id}: cannot write {path}: {written.observation()[-300:]}")
            script = path
        run = await sandbox.exec(["bash", script], limits=self.test_limits(inst))
        if run.timed_out:
            raise TimeoutError(f"the tests of {inst.instance_id} exceeded {run.wall_limit_s:g} s")
        if smith:
            verdict = await self._grade_smith(inst, run.output)
        else:
            verdict = grading.grade(run.output, meta["fail_to_pass"], meta["pass_to_pass"],
                                    log_parser=meta["log_parser"], eval_type=meta["eval_type"],
                                    instance_id=inst.instance_id, repo=meta["repo"])
        return with_test_seconds(verdict, run.duration_s)

    async def _grade_smith(self, inst: TaskInstance, log: str) -> Verdict:
        """SWE-smith's own report (the profile's parser) on the log, from the harness worker."""
        grading.check_ran(log)
        if self._harness is None:
            self._harness = HarnessWorker(self._harness_python)
        got = await asyncio.to_thread(self._harness.call, {"op": "grade_swesmith", "record": inst.metadata["record"],
                                                           "log": log})
        report = got["tests_status"]
        if report is None:  # the harness found no test output: a patch that did not apply, else no run
            if grading.apply_patch_fail() in log:
                return Verdict(0.0, detail=json.dumps({"resolution": "PATCH_APPLY_FAILED"}))
            raise GradingError(f"SWE-smith's harness found no test output: ...{log[-400:]}")
        if not got["resolved"] and (why := grading.infrastructure_failure(log)) is not None:
            raise GradingError(f"the test environment failed ({why}): ...{log[-400:]}")
        tests = {t: status for kind in ("FAIL_TO_PASS", "PASS_TO_PASS")
                 for status, names in (("PASSED", report[kind]["success"]), ("FAILED", report[kind]["failure"]))
                 for t in names}
        summary = {k: {"success": len(report[k]["success"]), "failure": len(report[k]["failure"])}
                   for k in ("FAIL_TO_PASS", "PASS_TO_PASS")}
        return Verdict(float(got["resolved"]), tests=tests,
                       detail=json.dumps({"resolution": "RESOLVED_FULL" if got["resolved"] else "UNRESOLVED", **summary}))

    def scripted_turns(self, inst: TaskInstance) -> list[str]:
        """The oracle: the gold patch applied (SWE-smith: the bug patch reverted), as the harness
        applies a prediction (``git apply``, then ``patch`` with fuzz)."""
        gold = inst.metadata["patch"]
        if not gold:
            raise NotImplementedError(f"instance {inst.instance_id} has no gold patch")
        reverse = "-R " if inst.metadata["harness"] == "swesmith" else ""
        path = "/tmp/.megathunder_gold.patch"
        apply = (f"git apply --verbose {reverse}{path} || patch --batch --fuzz=5 -p1 {reverse}-i {path}")
        return [tool_call_text("write_file", path=path, content=gold), tool_call_text("bash", command=apply),
                "The fix is applied."]

    def close(self) -> None:
        if self._harness is not None:
            self._harness.close()


def with_test_seconds(verdict: Verdict, seconds: float) -> Verdict:
    """``verdict`` with the test run's seconds in its detail (``megathunder bench tasks``)."""
    detail = json.loads(verdict.detail) if verdict.detail else {}
    return replace(verdict, detail=json.dumps({**detail, "test_s": round(seconds, 3)}))


class ContainerTestTask(SweTask):
    """A SWE task read from a file by ``loader`` (``load_swe_bench`` or ``load_swe_smith``)."""

    def __init__(self, name: str, loader: Callable[[str], Sequence[TaskInstance]], path: str,
                 test_run: TestRunLimits | None = None, harness_python: str | None = None) -> None:
        super().__init__(name, loader(path), test_run, harness_python)
