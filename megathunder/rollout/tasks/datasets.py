"""Loaders for SWE-bench (Verified) and SWE-smith instances from local files, and the SWE task.

Files are JSONL (one JSON object per line) or parquet (the Hugging Face layout; needs pyarrow).
Every error names the file, the record (line number or row) and the field. Each instance carries
its container image; the episode's container is started from it (docker, apptainer, enroot). The
repository is at ``/testbed`` in SWE-bench and SWE-smith images: set ``sandbox.workdir=/testbed``.

Set-up, as the harnesses do it:

- SWE-bench: the image holds the repository at ``base_commit`` with its environment; the agent
  works on it as is. The test patch is *not* applied before the episode (the agent never sees
  the new tests): it is part of the eval script that grades the episode.
- SWE-smith: the image holds the unbroken repository; each instance is a branch named by its
  ``instance_id`` carrying the bug (SWE-smith's harness checks it out). Set-up checks the branch
  out when the image has it, else applies the record's ``patch`` (the bug, as a diff) -- so the
  agent always works on the buggy repository, and set-up fails clearly if neither works.

Grading (``grading.py``): the record's ``eval_script`` (SWE-bench 5.x records carry one, with
``log_parser`` and ``eval_type``), or one assembled from ``test_patch`` and ``test_command``; the
log is parsed by the harness's parser and the reward is the resolved rule. Without a
``test_command`` the command is ``pytest -rA`` on the test files of FAIL_TO_PASS and
PASS_TO_PASS (the harness's command for Python repositories other than Django and SymPy, whose
records need an ``eval_script`` or ``test_command``).
"""

from __future__ import annotations

import json
import shlex
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from megathunder.rollout.tasks import grading
from megathunder.rollout.tasks.grading import GradingError
from megathunder.rollout.tasks.task import Task, TaskInstance
from megathunder.rollout.sandbox import SandboxError
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


def swe_bench_image(instance_id: str, namespace: str = "swebench", arch: str = "x86_64") -> str:
    """The SWE-bench harness's instance image name (its docker hub form: '__' -> '_1776_')."""
    return f"{namespace}/sweb.eval.{arch}.{instance_id.lower()}:latest".replace("__", "_1776_")


_NEEDS_COMMAND = {"django/django", "sympy/sympy"}


def patch_files(patch: str) -> list[str]:
    """The files a unified diff touches (its ``diff --git a/X b/X`` headers, else ``+++ b/X``)."""
    files = re.findall(r"^diff --git a/(\S+) b/\S+", patch, re.M) or re.findall(r"^\+\+\+ b/(\S+)", patch, re.M)
    return list(dict.fromkeys(files))


def _repo_instance(where: str, rec: dict, image: str, setup: list[str]) -> TaskInstance:
    f2p, p2p = (
        _field(where, rec, "FAIL_TO_PASS", list),
        _field(where, rec, "PASS_TO_PASS", list, []),
    )
    repo = _field(where, rec, "repo")
    test_patch = _field(where, rec, "test_patch", str, "")
    try:
        parser = grading.check_log_parser(
            _field(where, rec, "log_parser", str, grading.LOG_PARSERS_BY_REPO.get(repo, grading.DEFAULT_LOG_PARSER)))
    except GradingError as err:
        raise DatasetError(f"{where}: field 'log_parser': {err}") from None
    eval_type = _field(where, rec, "eval_type", str, "pass_and_fail")
    if eval_type not in ("pass_and_fail", "fail_only"):
        raise DatasetError(f"{where}: field 'eval_type' must be pass_and_fail or fail_only, got {eval_type!r}")
    if "eval_script" in rec and rec["eval_script"] is not None:
        script = grading.record_eval_script(_field(where, rec, "eval_script"))
    else:
        command = _field(where, rec, "test_command", str, None)
        if command is None:
            if repo in _NEEDS_COMMAND:
                raise DatasetError(f"{where}: missing field 'eval_script' (or 'test_command'): {repo}'s "
                                   "harness command is not pytest")
            files = [t.split("::")[0] for t in f2p + p2p]
            command = "pytest -rA " + shlex.join(list(dict.fromkeys(files)))
        base = rec.get("base_commit") if isinstance(rec.get("base_commit"), str) else None
        try:
            script = grading.eval_script(command, test_patch, reset_files=patch_files(test_patch) if base else (),
                                         reset_to=base)
        except GradingError as err:
            raise DatasetError(f"{where}: field 'test_patch': {err}") from None
    timeout = rec.get("test_timeout_s")
    return TaskInstance(
        instance_id=_field(where, rec, "instance_id"),
        prompt=_field(where, rec, "problem_statement"),
        image=image,
        metadata={
            "repo": repo,
            "fail_to_pass": f2p,
            "pass_to_pass": p2p,
            "eval_script": script,
            "log_parser": parser,
            "eval_type": eval_type,
            "setup": setup,
            "test_timeout_s": float(timeout) if isinstance(timeout, (int, float)) else None,
        },
    )


def load_swe_bench(path: str | Path) -> list[TaskInstance]:
    """SWE-bench (Verified) records; the image is the harness's unless ``image_name`` is given."""
    out = []
    for where, rec in read_records(path):
        iid = _field(where, rec, "instance_id")
        _field(where, rec, "base_commit")
        image = _field(where, rec, "image_name", str, swe_bench_image(iid))
        out.append(_repo_instance(where, rec, image, []))
    return out


def swe_smith_setup(instance_id: str, patch: str) -> list[str]:
    """SWE-smith's instance set-up: check out the instance's branch, or apply its bug ``patch``."""
    branch = shlex.quote(instance_id)
    missing = f"echo 'no branch {branch} in the repository, and the record has no patch' >&2; false"
    apply = f"git apply - <<'EOF_MEGATHUNDER_BUG'\n{patch.rstrip()}\nEOF_MEGATHUNDER_BUG" if patch else missing
    return [f"if git rev-parse -q --verify refs/heads/{branch} >/dev/null; then git checkout -q {branch}\n"
            f"else {apply}\nfi"]


def load_swe_smith(path: str | Path) -> list[TaskInstance]:
    """SWE-smith records; each names its environment image in ``image_name``."""
    out = []
    for where, rec in read_records(path):
        iid, image = _field(where, rec, "instance_id"), _field(where, rec, "image_name")
        out.append(_repo_instance(where, rec, image, swe_smith_setup(iid, _field(where, rec, "patch", str, ""))))
    return out


class SweTask(Task):
    """SWE-style instances (SWE-bench record format); reward = resolved, graded as the harness does."""

    system_prompt = (
        "You are a software engineer working in a repository. Reply without a tool call when done."
    )
    tools = (BASH, READ_FILE, WRITE_FILE, STR_REPLACE)
    verifies_in_sandbox = True

    def __init__(self, name: str, instances: Sequence[TaskInstance]) -> None:
        if not instances:
            raise DatasetError(f"task {name}: no instances")
        self.name, self._all = name, list(instances)

    def instances(self, num: int, seed: int = 0) -> list[TaskInstance]:
        return [self._all[(seed + k) % len(self._all)] for k in range(num)]

    async def setup(self, inst, sandbox) -> None:
        await super().setup(inst, sandbox)
        for command in inst.metadata["setup"]:
            done = await sandbox.shell(command)
            if not done.ok:
                raise SandboxError(f"instance {inst.instance_id}: set-up failed: {done.observation()[-500:]}")

    async def verify(self, inst, episode, sandbox) -> Verdict:
        meta = inst.metadata
        await sandbox.upload({EVAL_SCRIPT: meta["eval_script"]})
        run = await sandbox.exec(["bash", EVAL_SCRIPT], timeout_s=meta["test_timeout_s"],
                                 max_output_bytes=MAX_LOG_BYTES)
        if run.timed_out:
            raise TimeoutError(f"the tests of {inst.instance_id} exceeded {run.wall_limit_s:g} s")
        return grading.grade(run.output, meta["fail_to_pass"], meta["pass_to_pass"], log_parser=meta["log_parser"],
                             eval_type=meta["eval_type"], instance_id=inst.instance_id, repo=meta["repo"])


EVAL_SCRIPT = ".megathunder_eval.sh"
MAX_LOG_BYTES = 8 << 20
"""The test log kept for grading (Django's suite prints ~1 MB); the rest is dropped."""


class ContainerTestTask(SweTask):
    """A SWE task read from a file by ``loader`` (``load_swe_bench`` or ``load_swe_smith``)."""

    def __init__(self, name: str, loader: Callable[[str], Sequence[TaskInstance]], path: str) -> None:
        super().__init__(name, loader(path))
