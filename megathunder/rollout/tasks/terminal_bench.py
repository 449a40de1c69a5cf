"""Terminal-Bench 1 and Terminal-Bench 2 / Harbor task directories, run as their harnesses run them.

A task set is a directory of task directories (or one task directory). Two layouts:

- Terminal-Bench 1: ``task.yaml`` (``instruction``; ``max_agent_timeout_sec``,
  ``max_test_timeout_sec``, ``parser_name``, ``run_tests_in_same_shell``), a ``Dockerfile`` (the
  usual one-service ``docker-compose.yaml`` beside it builds it), ``run-tests.sh`` and ``tests/``;
  an optional ``solution.sh``. Grading copies ``run-tests.sh`` and the contents of ``tests/`` to
  ``/tests`` and runs ``bash /tests/run-tests.sh`` with ``TEST_DIR=/tests`` in the work dir; the
  harness's parser (``pytest``, the only one accepted) reads the pytest summary of its output and
  the task is solved when every listed test passed (skipped and xfail count as passed).
  ``run_tests_in_same_shell`` changes nothing here: the bash tool keeps no shell between calls,
  so the tests run in a fresh shell at the work dir either way.
- Terminal-Bench 2 / Harbor: ``task.toml`` (``[agent] timeout_sec``; ``[verifier] timeout_sec``,
  ``env``; ``[environment] docker_image``, ``allow_internet`` (default true), ``cpus``,
  ``memory_mb`` (or ``memory = "4G"``), ``workdir``, ``build_timeout_sec``), ``instruction.md``,
  ``environment/`` (``Dockerfile`` or ``docker-compose.yaml``), ``tests/test.sh``,
  ``solution/solve.sh``. Grading copies ``tests/`` to ``/tests`` and runs ``bash /tests/test.sh``,
  which writes its reward to ``/logs/verifier/reward.txt`` (a number) or ``reward.json``
  (``{"reward": x}``).

What the harness sets, the episode gets: the image built from the task's Dockerfile (tagged with
a hash of its build context, so an edited task is rebuilt), its WORKDIR (or Harbor's ``workdir``)
as the work dir, a network when the harness gives one (Terminal-Bench 1 always; Harbor with
``allow_internet``), its CPUs and memory as the container's, the agent's time limit and the test
run's (the task's, else ``agent.episode_wall_time_s`` and ``task.test_run.wall_time_s``). Fields
the harness has but nothing here enforces are refused (``gpus``, a verifier or agent ``user``,
a parser other than pytest) or warned about once (``storage_mb``).

Infrastructure failures are errors of the episode, never a reward (``grading.GradingError``): no
pytest summary in a Terminal-Bench 1 log (its tests never ran), no reward file from a Harbor test
script, and a failing run whose log carries one of the SWE-bench harness's environment signatures
(the network or the container runtime unreachable). A test killed for exceeding its memory (the
container's OOM killer) is a failed test.

The local sandbox has no images: it runs a task only when its Dockerfile is files copied into its
work dir (``dockerfile_layout.py``), mounting them at the task's own paths (bwrap); it refuses the
others naming the task. Tests are never in the sandbox during the episode: ``verify`` copies them.
A malformed task (a missing file, an unreadable or wrong-typed field) is skipped with a warning
naming the file and field; the rest of the set loads, and a set with no valid task is an error.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import logging
import re
import tarfile
import time
import tomllib
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from megathunder.config import TestRunLimits
from megathunder.rollout.sandbox import Environment, ImageBuild, LocalLayout, LocalSandbox, Sandbox, SandboxError
from megathunder.rollout.tasks import grading
from megathunder.rollout.tasks.datasets import DatasetError, with_test_seconds
from megathunder.rollout.tasks.dockerfile_layout import local_layout
from megathunder.rollout.tasks.grading import GradingError
from megathunder.rollout.tasks.task import DatasetTask, TaskInstance, tool_call_text
from megathunder.rollout.tools import BASH, READ_FILE, STR_REPLACE, WRITE_FILE
from megathunder.rollout.verifiers import Verdict

log = logging.getLogger(__name__)

TESTS_DIR, LOGS_DIR, SOLUTION_DIR = "/tests", "/logs/verifier", "/solution"
SCRATCH = ("/tests", "/logs", "/solution")  # what the harness writes outside the work dir
MAX_FILE_BYTES = 4 << 20  # a larger test or solution file is not uploaded (a binary asset)
_TB1_PASSED = {"PASSED", "XFAIL", "SKIPPED"}  # the Terminal-Bench 1 pytest parser's passing states
_TB1_STATES = _TB1_PASSED | {"FAILED", "XPASS", "ERROR"}


def _files(under: Path) -> dict[str, bytes]:
    out = {}
    for p in sorted(under.rglob("*")):
        if p.is_file() and not p.is_symlink():
            if p.stat().st_size > MAX_FILE_BYTES:
                log.warning("%s: larger than %d MiB, not uploaded", p, MAX_FILE_BYTES >> 20)
                continue
            out[p.relative_to(under).as_posix()] = p.read_bytes()
    return out


def _number(where: Path, table: Mapping[str, Any], key: str, name: str) -> float | None:
    value = table.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise DatasetError(f"{where}: field {name!r} must be a positive number, got {value!r}")
    return float(value)


def _memory_mb(where: Path, env: Mapping[str, Any]) -> int | None:
    """Harbor's ``memory_mb`` (a number), or the older ``memory`` ("4G", "512M")."""
    if (mb := _number(where, env, "memory_mb", "environment.memory_mb")) is not None:
        return int(mb)
    text = env.get("memory")
    if text is None:
        return None
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([GMgm])i?[Bb]?\s*", str(text))
    if not found:
        raise DatasetError(f"{where}: field 'environment.memory' must be like '4G' or '512M', got {text!r}")
    return int(float(found.group(1)) * (1024 if found.group(2).lower() == "g" else 1))


def _text(path: Path) -> str:
    try:
        return path.read_text()
    except UnicodeDecodeError as err:
        raise DatasetError(f"{path}: not UTF-8 ({err.reason} at byte {err.start})") from None


def _context_hash(context: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(context.rglob("*")):
        if p.is_file():
            h.update(p.relative_to(context).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def _compose_dockerfile(compose: Path, context: Path) -> Path | None:
    """The Dockerfile of a one-service compose file that builds it (Terminal-Bench 1's layout)."""
    try:
        spec = yaml.safe_load(_text(compose))
    except yaml.YAMLError:
        return None
    services = spec.get("services") if isinstance(spec, dict) else None
    if not isinstance(services, dict) or len(services) != 1:
        return None
    build = next(iter(services.values())).get("build") if isinstance(next(iter(services.values())), dict) else None
    if build in (".", "./"):
        build = {}
    if not isinstance(build, dict) or build.get("context", ".") not in (".", "./"):
        return None
    dockerfile = context / str(build.get("dockerfile", "Dockerfile"))
    return dockerfile if dockerfile.is_file() else None


def _environment(name: str, task_dir: Path, env_dir: Path, image: str | None, **settings: Any) -> tuple[str, Environment]:
    """The instance's image and what its sandbox must provide (see the module docstring)."""
    compose = next((c for c in (env_dir / "docker-compose.yaml", env_dir / "docker-compose.yml") if c.is_file()), None)
    dockerfile = env_dir / "Dockerfile"
    if compose is not None and (found := _compose_dockerfile(compose, env_dir)) is not None:
        dockerfile, compose = found, None
    build: ImageBuild | None = None
    if image is not None:  # a prebuilt image (Harbor's docker_image) is used as it is
        layout = LocalLayout(refusal=f"its environment is the prebuilt image {image}")
    elif compose is not None:
        build = ImageBuild(str(env_dir), compose_file=str(compose))
        layout = LocalLayout(refusal=f"{compose}: a docker-compose environment of several services or images")
    elif dockerfile.is_file():
        build = ImageBuild(str(env_dir), dockerfile=str(dockerfile), timeout_s=settings.pop("build_timeout_s") or 1800.0)
        layout = local_layout(dockerfile, env_dir)
    else:
        raise DatasetError(f"{env_dir}: no Dockerfile or docker-compose.yaml (the task's environment)")
    settings.pop("build_timeout_s", None)
    tag = image or f"megathunder-tb/{task_dir.name.lower()}:{_context_hash(env_dir)}"
    return tag, Environment(name=name, build=build, local=layout, scratch_dirs=SCRATCH, **settings)


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
    parser = spec.get("parser_name") or "pytest"
    if parser != "pytest":
        raise DatasetError(f"{spec_path}: field 'parser_name': {parser!r} is not supported (only pytest's summary "
                           "is read here)")
    run_tests = task_dir / "run-tests.sh"
    if not run_tests.is_file():
        raise DatasetError(f"{run_tests}: missing (the task's test script)")
    image, env = _environment(task_dir.name, task_dir, task_dir, None, network=True, build_timeout_s=None)
    tests = {"run-tests.sh": run_tests.read_bytes(),
             **(_files(task_dir / "tests") if (task_dir / "tests").is_dir() else {})}
    solution = task_dir / "solution.sh"
    return TaskInstance(
        instance_id=task_dir.name, prompt=instruction, image=image, environment=env,
        files=env.local.files if env.local else {},
        agent_timeout_s=_number(spec_path, spec, "max_agent_timeout_sec", "max_agent_timeout_sec"),
        test_timeout_s=_number(spec_path, spec, "max_test_timeout_sec", "max_test_timeout_sec"),
        metadata={"format": "terminal_bench_1", "tests": tests, "test_command": f"bash {TESTS_DIR}/run-tests.sh",
                  "test_env": {"TEST_DIR": TESTS_DIR},
                  "solution": {"solution.sh": solution.read_bytes()} if solution.is_file() else None,
                  "solve": f"bash {SOLUTION_DIR}/solution.sh"},
    )  # fmt: skip


def load_harbor_task(task_dir: Path) -> TaskInstance:
    """One Terminal-Bench 2 / Harbor task directory."""
    spec_path = task_dir / "task.toml"
    try:
        spec = tomllib.loads(_text(spec_path))
    except tomllib.TOMLDecodeError as err:
        raise DatasetError(f"{spec_path}: not valid TOML ({err})") from None
    tables: dict[str, dict[str, Any]] = {}
    for name in ("verifier", "agent", "environment", "metadata"):
        table = spec.get(name, {})
        if not isinstance(table, dict):
            raise DatasetError(f"{spec_path}: field {name!r} must be a table, got {type(table).__name__}")
        tables[name] = table
    env, verifier, agent = tables["environment"], tables["verifier"], tables["agent"]
    for table, key in ((verifier, "user"), (agent, "user")):
        if table.get(key) is not None:
            raise DatasetError(f"{spec_path}: field '{'verifier' if table is verifier else 'agent'}.user' is not "
                               "supported (commands run as the image's user)")
    if (_number(spec_path, env, "gpus", "environment.gpus") or 0) > 0:
        raise DatasetError(f"{spec_path}: field 'environment.gpus': sandboxes have no GPUs")
    if env.get("storage_mb") is not None or env.get("storage") is not None:
        log.warning("%s: environment storage is not enforced here (the container's disk is the host's)", spec_path)
    allow = env.get("allow_internet", True)
    if not isinstance(allow, bool):
        raise DatasetError(f"{spec_path}: field 'environment.allow_internet' must be true or false, got {allow!r}")
    workdir = env.get("workdir")
    if workdir is not None and (not isinstance(workdir, str) or not workdir.startswith("/")):
        raise DatasetError(f"{spec_path}: field 'environment.workdir' must be an absolute path, got {workdir!r}")
    test_env = verifier.get("env", {})
    if not isinstance(test_env, dict) or not all(isinstance(v, str) for v in test_env.values()):
        raise DatasetError(f"{spec_path}: field 'verifier.env' must be a table of strings")
    instruction_path = task_dir / "instruction.md"
    if not instruction_path.is_file():
        raise DatasetError(f"{instruction_path}: missing (the task's instruction)")
    instruction = _text(instruction_path)
    if not instruction.strip():
        raise DatasetError(f"{instruction_path}: empty")
    test_sh = task_dir / "tests" / "test.sh"
    if not test_sh.is_file():
        raise DatasetError(f"{test_sh}: missing (the task's test script)")
    docker_image = env.get("docker_image")
    if docker_image is not None and (not isinstance(docker_image, str) or not docker_image.strip()):
        raise DatasetError(f"{spec_path}: field 'environment.docker_image' must be a non-empty string")
    env_dir = task_dir / "environment"
    if not env_dir.is_dir() and docker_image is None:
        raise DatasetError(f"{env_dir}: missing (the task's environment), and no 'environment.docker_image'")
    image, environment = _environment(
        task_dir.name, task_dir, env_dir, docker_image, network=allow, workdir=workdir,
        cpus=_number(spec_path, env, "cpus", "environment.cpus"), memory_mb=_memory_mb(spec_path, env),
        build_timeout_s=_number(spec_path, env, "build_timeout_sec", "environment.build_timeout_sec"))
    if workdir is not None and environment.local is not None and environment.local.workdir not in (None, workdir):
        environment = replace(environment, local=LocalLayout(
            refusal=f"{spec_path}: workdir {workdir} is not its Dockerfile's WORKDIR {environment.local.workdir}"))
    solution_dir = task_dir / "solution"
    return TaskInstance(
        instance_id=task_dir.name, prompt=instruction, image=image, environment=environment,
        files=environment.local.files if environment.local else {},
        agent_timeout_s=_number(spec_path, agent, "timeout_sec", "agent.timeout_sec"),
        test_timeout_s=_number(spec_path, verifier, "timeout_sec", "verifier.timeout_sec"),
        metadata={"format": "harbor", "tests": _files(task_dir / "tests"), "test_command": f"bash {TESTS_DIR}/test.sh",
                  "test_env": dict(test_env),
                  "solution": _files(solution_dir) if (solution_dir / "solve.sh").is_file() else None,
                  "solve": f"bash {SOLUTION_DIR}/solve.sh"},
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


def tb1_pytest_results(output: str) -> dict[str, str]:
    """Terminal-Bench 1's pytest parser's reading: each test of the ``short test summary info``
    section (``STATUS path::name [- message]``) and its status; none found raises
    :class:`GradingError` (the tests never ran: the harness's parse error)."""
    _, found, summary = output.rpartition("short test summary info")
    if not found:
        raise GradingError(f"no pytest summary in the test output (the tests never ran): ...{output[-400:]}")
    results = {}
    for line in summary.splitlines():
        status, _, rest = line.strip().partition(" ")
        if status in _TB1_STATES and rest:
            results[rest.split(" - ")[0].strip()] = status
    if not results:
        raise GradingError(f"the pytest summary lists no test: ...{output[-400:]}")
    return results


class TerminalBenchTask(DatasetTask):
    """Tasks from Terminal-Bench 1 / Harbor directories; reward from the task's own tests."""

    name = "terminal_bench"
    system_prompt = "You operate a Linux shell to complete the task. Reply without a tool call when done."
    tools = (BASH, READ_FILE, WRITE_FILE, STR_REPLACE)

    def __init__(self, path: str, test_run: TestRunLimits | None = None) -> None:
        super().__init__(load_terminal_bench(path), test_run)

    async def setup(self, inst, sandbox) -> None:
        if inst.files and isinstance(sandbox, LocalSandbox):
            await sandbox.upload(inst.files)  # a container has them from its image

    async def verify(self, inst, episode, sandbox) -> Verdict:
        meta = inst.metadata
        await upload_to(sandbox, TESTS_DIR, meta["tests"])
        env = " ".join(f"{k}={_quote(v)}" for k, v in meta["test_env"].items())
        run = await sandbox.exec(["bash", "-c", f"mkdir -p {LOGS_DIR} && {env} {meta['test_command']}"],
                                 limits=self.test_limits(inst))
        if run.timed_out:
            raise TimeoutError(f"the tests of {inst.instance_id} exceeded {run.wall_limit_s:g} s")
        detail: dict[str, Any] = {"exit_code": run.exit_code, "oom_killed": run.oom_killed,
                                  "log_tail": run.output[-2000:]}
        if meta["format"] == "terminal_bench_1":
            results = tb1_pytest_results(run.output)
            reward = float(all(s in _TB1_PASSED for s in results.values()))
            verdict = Verdict(reward, tests=results, detail=json.dumps(detail))
        else:
            txt = await sandbox.read_file(f"{LOGS_DIR}/reward.txt")
            js = await sandbox.read_file(f"{LOGS_DIR}/reward.json")
            verdict = Verdict(harbor_reward(txt.output if txt.ok else None, js.output if js.ok else None),
                              detail=json.dumps(detail))
        if verdict.reward <= 0 and (why := grading.infrastructure_failure(run.output)) is not None:
            raise GradingError(f"the test environment failed ({why}): ...{run.output[-400:]}")
        return with_test_seconds(verdict, run.duration_s)

    def scripted_turns(self, inst: TaskInstance) -> list[str]:
        """The oracle, as the harness's runs it: the solution's files in ``/solution``, then its
        script under bash in the work dir."""
        files = inst.metadata["solution"]
        if not files:
            raise NotImplementedError(f"task {inst.instance_id} has no solution script")
        turns = []
        for rel, content in files.items():  # a text file as it is, a binary one as base64
            path = f"{SOLUTION_DIR}/{rel}"
            try:
                turns.append(tool_call_text("write_file", path=path, content=content.decode()))
            except UnicodeDecodeError:
                data = base64.b64encode(content).decode()
                turns.append(tool_call_text("bash", command=f"mkdir -p \"$(dirname {_quote(path)})\" && "
                                                            f"echo {data} | base64 -d > {_quote(path)}"))
        return [*turns, tool_call_text("bash", command=inst.metadata["solve"]), "Done."]


def _quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"
