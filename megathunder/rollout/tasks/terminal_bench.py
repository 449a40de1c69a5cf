"""Terminal-Bench 1 and Terminal-Bench 2 / Harbor task directories.

A task set is a directory of task directories (or one task directory). Two layouts:

- Terminal-Bench 1: ``task.yaml`` (``instruction``; optional ``max_test_timeout_sec``), a
  ``Dockerfile`` or ``docker-compose.yaml`` at the top, ``run-tests.sh`` and ``tests/``; an
  optional ``solution.sh``. Grading copies ``run-tests.sh`` and the contents of ``tests/`` to
  ``/tests`` and runs
  ``bash /tests/run-tests.sh`` with ``TEST_DIR=/tests``: reward 1 when it exits 0.
- Terminal-Bench 2 / Harbor: ``task.toml`` (optional ``[verifier] timeout_sec``, ``[environment]
  docker_image``), ``instruction.md``, ``environment/`` (``Dockerfile`` or
  ``docker-compose.yaml``), ``tests/test.sh``, ``solution/solve.sh``. Grading copies ``tests/`` to
  ``/tests`` and runs ``bash /tests/test.sh``, which writes its reward to
  ``/logs/verifier/reward.txt`` (a number) or ``reward.json`` (``{"reward": x}``); no reward file
  is a verifier error (the failure policy), as in Harbor.

Environment: each instance names its image (``[environment] docker_image``, else
``megathunder-tb/<task>:latest``) and how to build it (:class:`ImageBuild`: the task's Dockerfile
and context, or its compose file) for the container backend. On the local sandbox there is no
image: the environment's other files are uploaded into the work directory, and the test files'
absolute ``/tests`` and ``/logs/verifier`` paths are mapped into it (``.megathunder/``), which
approximates the task's environment only as far as the host's tools match its image.

Tests are never in the sandbox during the episode: they are copied in after it, by ``verify``.
A malformed task (a missing file, an unreadable or wrong-typed field) is skipped with a warning
naming the file and field; the rest of the set loads, and a set with no valid task is an error.
"""

from __future__ import annotations

import io
import json
import logging
import re
import tarfile
import time
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from megathunder.rollout.sandbox import LocalSandbox, Sandbox, SandboxError
from megathunder.rollout.tasks.datasets import DatasetError
from megathunder.rollout.tasks.grading import GradingError
from megathunder.rollout.tasks.task import ImageBuild, Task, TaskInstance, tool_call_text
from megathunder.rollout.tools import BASH, READ_FILE, STR_REPLACE, WRITE_FILE
from megathunder.rollout.verifiers import Verdict

log = logging.getLogger(__name__)

TESTS_DIR, LOGS_DIR = "/tests", "/logs/verifier"
LOCAL_DIR = ".megathunder"  # under the local sandbox's work dir: its tests/ and logs/verifier/
MAX_FILE_BYTES = 4 << 20  # a larger environment or test file is not uploaded (a binary asset)
_NOT_ENV = {"task.yaml", "task.toml", "Dockerfile", "docker-compose.yaml", "docker-compose.yml",
            "run-tests.sh", "solution.sh", "instruction.md"}


def _files(root: Path, under: Path, skip_dirs: tuple[str, ...] = ()) -> dict[str, bytes]:
    out = {}
    for p in sorted(under.rglob("*")):
        rel = p.relative_to(root)
        if p.is_file() and not p.is_symlink() and rel.parts[0] not in skip_dirs and str(rel) not in _NOT_ENV:
            if p.stat().st_size > MAX_FILE_BYTES:
                log.warning("%s: larger than %d MiB, not uploaded", p, MAX_FILE_BYTES >> 20)
                continue
            out[str(p.relative_to(under))] = p.read_bytes()
    return out


def _number(where: Path, table: Mapping[str, Any], key: str, name: str) -> float | None:
    value = table.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise DatasetError(f"{where}: field {name!r} must be a positive number, got {value!r}")
    return float(value)


def _text(path: Path) -> str:
    try:
        return path.read_text()
    except UnicodeDecodeError as err:
        raise DatasetError(f"{path}: not UTF-8 ({err.reason} at byte {err.start})") from None


def _environment(task_dir: Path, env_dir: Path, image: str | None) -> tuple[str, ImageBuild | None]:
    dockerfile, compose = env_dir / "Dockerfile", [env_dir / f"docker-compose.{e}" for e in ("yaml", "yml")]
    found = next((c for c in compose if c.is_file()), None)
    build = None
    if dockerfile.is_file():
        build = ImageBuild(str(env_dir), dockerfile=str(dockerfile))
    elif found is not None:
        build = ImageBuild(str(env_dir), compose_file=str(found))
    elif image is None:
        raise DatasetError(f"{env_dir}: no Dockerfile or docker-compose.yaml (the task's environment)")
    return image or f"megathunder-tb/{task_dir.name.lower()}:latest", build


def load_tb1_task(task_dir: Path) -> TaskInstance:
    """One Terminal-Bench 1 task directory."""
    spec_path = task_dir / "task.yaml"
    try:
        spec = yaml.safe_load(_text(spec_path))
    except yaml.YAMLError as err:
        raise DatasetError(f"{spec_path}: not valid YAML ({err})") from None
    if not isinstance(spec, dict):
        raise DatasetError(f"{spec_path}: expected a mapping, got {type(spec).__name__}")
    instruction = spec.get("instruction")
    if instruction is None and isinstance(spec.get("descriptions"), list):  # the early layout
        instruction = next((d.get("description") for d in spec["descriptions"]
                            if isinstance(d, dict) and d.get("key") == "base"), None)
    if not isinstance(instruction, str) or not instruction.strip():
        raise DatasetError(f"{spec_path}: field 'instruction' must be a non-empty string, got {instruction!r}")
    run_tests = task_dir / "run-tests.sh"
    if not run_tests.is_file():
        raise DatasetError(f"{run_tests}: missing (the task's test script)")
    image, build = _environment(task_dir, task_dir, None)
    tests = {f"tests/{k}": v for k, v in _files(task_dir, task_dir / "tests").items()} if (task_dir / "tests").is_dir() else {}
    tests["run-tests.sh"] = run_tests.read_bytes()
    solution = task_dir / "solution.sh"
    return TaskInstance(
        instance_id=task_dir.name, prompt=instruction, image=image, build=build,
        files=_files(task_dir, task_dir, skip_dirs=("tests", "solution")),
        metadata={"format": "terminal_bench_1", "tests": tests, "test_command": f"bash {TESTS_DIR}/run-tests.sh",
                  "test_timeout_s": _number(spec_path, spec, "max_test_timeout_sec", "max_test_timeout_sec"),
                  "solution": _text(solution) if solution.is_file() else None},
    )  # fmt: skip


def load_harbor_task(task_dir: Path) -> TaskInstance:
    """One Terminal-Bench 2 / Harbor task directory."""
    spec_path = task_dir / "task.toml"
    try:
        spec = tomllib.loads(_text(spec_path))
    except tomllib.TOMLDecodeError as err:
        raise DatasetError(f"{spec_path}: not valid TOML ({err})") from None
    tables = {}
    for name in ("verifier", "agent", "environment", "metadata"):
        table = spec.get(name, {})
        if not isinstance(table, dict):
            raise DatasetError(f"{spec_path}: field {name!r} must be a table, got {type(table).__name__}")
        tables[name] = table
    instruction_path = task_dir / "instruction.md"
    if not instruction_path.is_file():
        raise DatasetError(f"{instruction_path}: missing (the task's instruction)")
    instruction = _text(instruction_path)
    if not instruction.strip():
        raise DatasetError(f"{instruction_path}: empty")
    test_sh = task_dir / "tests" / "test.sh"
    if not test_sh.is_file():
        raise DatasetError(f"{test_sh}: missing (the task's test script)")
    docker_image = tables["environment"].get("docker_image")
    if docker_image is not None and (not isinstance(docker_image, str) or not docker_image.strip()):
        raise DatasetError(f"{spec_path}: field 'environment.docker_image' must be a non-empty string")
    env_dir = task_dir / "environment"
    if not env_dir.is_dir() and docker_image is None:
        raise DatasetError(f"{env_dir}: missing (the task's environment), and no 'environment.docker_image'")
    image, build = _environment(task_dir, env_dir, docker_image) if env_dir.is_dir() else (docker_image, None)
    solve = task_dir / "solution" / "solve.sh"
    return TaskInstance(
        instance_id=task_dir.name, prompt=instruction, image=image, build=build,
        files=_files(env_dir, env_dir) if env_dir.is_dir() else {},
        metadata={"format": "harbor", "tests": {f"tests/{k}": v for k, v in _files(task_dir, task_dir / "tests").items()},
                  "test_command": f"bash {TESTS_DIR}/test.sh",
                  "test_timeout_s": _number(spec_path, tables["verifier"], "timeout_sec", "verifier.timeout_sec"),
                  "solution": _text(solve) if solve.is_file() else None},
    )  # fmt: skip


def load_task_dirs(path: str | Path) -> tuple[list[TaskInstance], list[str]]:
    """The tasks under ``path`` (a task directory, or a directory of them) and, for each task
    directory that could not be loaded, why (the file and field)."""
    root = Path(path)
    if not root.is_dir():
        raise DatasetError(f"{root}: not a directory of tasks")
    is_task = lambda d: (d / "task.yaml").is_file() or (d / "task.toml").is_file()  # noqa: E731
    dirs = [root] if is_task(root) else sorted(d for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    out, skipped = [], []
    for d in dirs:
        try:
            if (d / "task.toml").is_file():
                out.append(load_harbor_task(d))
            elif (d / "task.yaml").is_file():
                out.append(load_tb1_task(d))
            else:
                raise DatasetError(f"{d}: no task.yaml (Terminal-Bench 1) or task.toml (Harbor)")
        except (DatasetError, OSError) as err:
            skipped.append(str(err))
    return out, skipped


def load_terminal_bench(path: str | Path) -> list[TaskInstance]:
    """:func:`load_task_dirs`, warning about the skipped tasks; no valid task is an error."""
    out, skipped = load_task_dirs(path)
    if skipped:
        log.warning("%s: skipped %d malformed task(s):\n  %s", path, len(skipped), "\n  ".join(skipped))
    if not out:
        raise DatasetError(f"{path}: no valid task" + "".join(f"\n  {s}" for s in skipped))
    return out


async def upload_to(sandbox: Sandbox, dest: str, files: Mapping[str, str | bytes]) -> None:
    """Create ``files`` (relative paths) under the absolute or work-dir-relative ``dest``."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for path, content in files.items():
            data = content.encode() if isinstance(content, str) else content
            info = tarfile.TarInfo(path)
            info.size, info.mtime, info.mode = len(data), int(time.time()), 0o755 if path.endswith(".sh") else 0o644
            tar.addfile(info, io.BytesIO(data))
    done = await sandbox.exec(["sh", "-c", 'mkdir -p "$1" && tar -x --no-same-owner -f - -C "$1"', "sh", dest],
                              stdin=buf.getvalue())
    if not done.ok:
        raise SandboxError(f"upload of {len(files)} files to {dest} failed: {done.observation()}")


def harbor_reward(reward_txt: str | None, reward_json: str | None) -> float:
    """The reward a Harbor test script wrote: ``reward.txt`` (a number), else ``reward.json``."""
    if reward_txt is not None and reward_txt.strip():
        try:
            return float(reward_txt.strip())
        except ValueError:
            raise GradingError(f"reward.txt is not a number: {reward_txt[:80]!r}") from None
    if reward_json is not None:
        try:
            data = json.loads(reward_json)
        except json.JSONDecodeError as err:
            raise GradingError(f"reward.json is not JSON ({err.msg})") from None
        value = data.get("reward") if isinstance(data, dict) else data
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise GradingError(f"reward.json has no numeric 'reward': {reward_json[:80]!r}")
    raise GradingError(f"the test script wrote no reward file ({LOGS_DIR}/reward.txt or reward.json)")


class TerminalBenchTask(Task):
    """Tasks from Terminal-Bench 1 / Harbor directories; reward from the task's own tests."""

    name = "terminal_bench"
    system_prompt = "You operate a Linux shell to complete the task. Reply without a tool call when done."
    tools = (BASH, READ_FILE, WRITE_FILE, STR_REPLACE)
    verifies_in_sandbox = True

    def __init__(self, path: str) -> None:
        self._all = load_terminal_bench(path)

    def instances(self, num: int, seed: int = 0) -> list[TaskInstance]:
        return [self._all[(seed + k) % len(self._all)] for k in range(num)]

    async def setup(self, inst, sandbox) -> None:
        if inst.files and isinstance(sandbox, LocalSandbox):  # a container has them from its image
            await sandbox.upload(inst.files)

    async def verify(self, inst, episode, sandbox) -> Verdict:
        meta = inst.metadata
        local = isinstance(sandbox, LocalSandbox)
        tests_dir = f"{sandbox.workdir}/{LOCAL_DIR}/tests" if local else TESTS_DIR
        logs_dir = f"{sandbox.workdir}/{LOCAL_DIR}/logs/verifier" if local else LOGS_DIR
        files: Mapping[str, str | bytes] = meta["tests"]
        if local:  # map the task's absolute paths into the work dir
            files = {k: _relocate(v, tests_dir, logs_dir) for k, v in files.items()}
        await upload_to(sandbox, tests_dir, {k.removeprefix("tests/"): v for k, v in files.items()})
        command = meta["test_command"].replace(TESTS_DIR, tests_dir)
        run = await sandbox.exec(["sh", "-c", f'mkdir -p "$1" && TEST_DIR="$2" {command}', "sh", logs_dir, tests_dir],
                                 timeout_s=meta["test_timeout_s"])
        if run.timed_out:
            raise TimeoutError(f"the tests of {inst.instance_id} exceeded {run.wall_limit_s:g} s")
        tail = run.output[-2000:]
        if meta["format"] == "terminal_bench_1":
            return Verdict(float(run.ok), detail=json.dumps({"exit_code": run.exit_code, "log_tail": tail}))
        txt = await sandbox.read_file(f"{logs_dir}/reward.txt")
        js = await sandbox.read_file(f"{logs_dir}/reward.json")
        reward = harbor_reward(txt.output if txt.ok else None, js.output if js.ok else None)
        return Verdict(reward, detail=json.dumps({"exit_code": run.exit_code, "log_tail": tail}))

    def scripted_turns(self, inst: TaskInstance) -> list[str]:
        if not inst.metadata["solution"]:
            raise NotImplementedError(f"task {inst.instance_id} has no solution script")
        return [tool_call_text("bash", command=inst.metadata["solution"]), "Done."]


def _relocate(content: str | bytes, tests_dir: str, logs_dir: str) -> str | bytes:
    if isinstance(content, bytes):
        try:
            text = content.decode()
        except UnicodeDecodeError:
            return content
    else:
        text = content
    text = re.sub(r"(?<![\w./-])/logs/verifier\b", logs_dir, text)
    return re.sub(r"(?<![\w./-])/tests\b", tests_dir, text)
