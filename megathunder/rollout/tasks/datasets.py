"""Loaders for SWE-bench Verified, SWE-smith and Terminal-Bench instances from local files.

Files are JSONL (one JSON object per line) or parquet (the Hugging Face layout; needs pyarrow).
Every error names the file, the record (line number or row) and the field. Each instance carries
its container image; the episode's container is started from it (docker, apptainer, enroot).

Rewards run the instance's tests in its container (the repository is at ``/testbed`` in SWE-bench
and SWE-smith images: set ``sandbox.workdir=/testbed``): apply the test patch if there
is one, then run ``test_command`` from the record, or by default ``python -m pytest`` on the
FAIL_TO_PASS and PASS_TO_PASS tests. SWE-bench's own harness uses per-repository commands (Django's
``runtests.py``, ...): put those in ``test_command`` to match it.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from megathunder.rollout.tasks.task import Task, TaskInstance
from megathunder.rollout.tools import BASH, READ_FILE, STR_REPLACE, WRITE_FILE


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


def _repo_instance(where: str, rec: dict, image: str) -> TaskInstance:
    f2p, p2p = (
        _field(where, rec, "FAIL_TO_PASS", list),
        _field(where, rec, "PASS_TO_PASS", list, []),
    )
    tests = shlex.join(f2p + p2p)
    return TaskInstance(
        instance_id=_field(where, rec, "instance_id"),
        prompt=_field(where, rec, "problem_statement"),
        image=image,
        metadata={
            "repo": _field(where, rec, "repo"),
            "fail_to_pass": f2p,
            "pass_to_pass": p2p,
            "test_patch": _field(where, rec, "test_patch", str, ""),
            "test_command": _field(where, rec, "test_command", str, f"python -m pytest -q {tests}"),
        },
    )


def load_swe_bench(path: str | Path) -> list[TaskInstance]:
    """SWE-bench (Verified) records; the image is the harness's unless ``image_name`` is given."""
    out = []
    for where, rec in read_records(path):
        iid = _field(where, rec, "instance_id")
        _field(where, rec, "base_commit")
        out.append(
            _repo_instance(where, rec, _field(where, rec, "image_name", str, swe_bench_image(iid)))
        )
    return out


def load_swe_smith(path: str | Path) -> list[TaskInstance]:
    """SWE-smith records; each names its environment image in ``image_name``."""
    return [_repo_instance(w, r, _field(w, r, "image_name")) for w, r in read_records(path)]


def load_terminal_bench(path: str | Path) -> list[TaskInstance]:
    """Terminal-Bench tasks: ``task_id``, ``instruction``, ``image`` (or ``docker_image``) and an
    optional ``test_command`` (default: the task's ``/tests/run-tests.sh``)."""
    out = []
    for where, rec in read_records(path):
        image_key = "image" if "image" in rec else "docker_image"
        out.append(
            TaskInstance(
                instance_id=_field(where, rec, "task_id"),
                prompt=_field(where, rec, "instruction"),
                image=_field(where, rec, image_key),
                metadata={
                    "test_patch": "",
                    "test_command": _field(
                        where, rec, "test_command", str, "bash /tests/run-tests.sh"
                    ),
                },
            )
        )
    return out


class ContainerTestTask(Task):
    """Instances from a loader; reward = the instance's tests pass in its container."""

    system_prompt = (
        "You are a software engineer working in a repository. Reply without a tool call when done."
    )
    tools = (BASH, READ_FILE, WRITE_FILE, STR_REPLACE)
    verifies_in_sandbox = True

    def __init__(
        self, name: str, loader: Callable[[str], Sequence[TaskInstance]], path: str
    ) -> None:
        self.name, self._all = name, list(loader(path))

    def instances(self, num: int, seed: int = 0) -> list[TaskInstance]:
        return [self._all[(seed + k) % len(self._all)] for k in range(num)]

    async def verify(self, inst, episode, sandbox) -> float:
        if inst.metadata["test_patch"]:
            await sandbox.upload({".megathunder_test.patch": inst.metadata["test_patch"]})
            applied = await sandbox.shell("git apply --reject .megathunder_test.patch")
            if not applied.ok:
                raise RuntimeError(f"test patch does not apply: {applied.observation()[-500:]}")
        return float((await sandbox.shell(inst.metadata["test_command"])).ok)
