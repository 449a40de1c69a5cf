"""Container backends as argument lists: the command lines are checked as built, and the lifecycle
runs against a stand-in CLI that executes the in-container part of each command (the limits
wrapper included) on the host. Apptainer and Enroot are checked only here; podman (with Docker's
command lines) also runs real episodes in tests/integration/test_podman_sandbox.py."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import stat

import pytest

from megathunder.config import ContainerSandboxConfig
from megathunder.rollout.sandbox import ContainerSandbox, SandboxError, build_sandbox
from megathunder.rollout.sandbox import container as ct


@pytest.fixture(autouse=True)
def _no_pid_files_left_on_the_host():
    """The stand-in CLI runs the in-container part on the host, so the commands' process-group
    files land in the host's /tmp (in a real container they go with it): remove them."""
    import glob

    patterns = ("/tmp/.megathunder-exec-megathunder-*", "/tmp/.megathunder_eval_*", "/tmp/.megathunder_grade_*")
    before = {p for pattern in patterns for p in glob.glob(pattern)}
    yield
    for path in {p for pattern in patterns for p in glob.glob(pattern)} - before:
        os.remove(path)


def _cfg(**kw):
    return ContainerSandboxConfig(
        **{"backend": "docker", "wall_time_s": 7, "cpu_time_s": 3, "memory_mb": 512, **kw}
    )


def test_docker_command_lines():
    cfg = _cfg(max_processes=32, cpus=2)
    start = ct.docker_start_argv(cfg, "swebench/sweb.eval.x86_64.a_1776_b:latest", "ep1")
    joined = " ".join(start)
    for flag in ("--network none", "--memory 512m", "--memory-swap 512m", "--pids-limit 32", "--cpus 2",
                 "--cap-drop ALL", "no-new-privileges", "--rm", "--detach"):  # fmt: skip
        assert flag in joined
    assert start[-4:] == [
        "--entrypoint",
        "sleep",
        "swebench/sweb.eval.x86_64.a_1776_b:latest",
        "infinity",
    ]
    assert "--workdir" not in start  # no work dir from the task or the config: the image's WORKDIR
    exec_ = ct.docker_exec_argv(cfg, "ep1", ["cat", "f"], True, 7, workdir="/workspace")
    assert exec_[:6] == ["docker", "exec", "--interactive", "--workdir", "/workspace", "ep1"]
    limits = ["prlimit", "--cpu=3:4", f"--as={512 << 20}", "--nproc=32", f"--fsize={64 << 20}", "--"]
    wall = ["timeout", "-s", "KILL", "7"]
    assert exec_[6:] == ["env", "PYTHONDONTWRITEBYTECODE=1", *wall, *limits, "cat", "f"]
    assert ct.docker_stop_argv(cfg, "ep1") == ["docker", "rm", "--force", "ep1"]


def test_a_task_s_environment_and_a_test_run_s_limits_in_the_command_lines():
    """The task's harness settings reach the container (network with sandbox.network=task, its
    CPUs, memory and work dir), and a test run's own limits replace the agent's tool limits."""
    from megathunder.rollout.sandbox import CommandLimits, Environment

    cfg = _cfg(max_processes=32, cpus=1)
    env = Environment(name="t", workdir="/app", network=True, cpus=2.5, memory_mb=3072)
    start = " ".join(ct.docker_start_argv(cfg, "img", "ep1", env))
    assert "--network" not in start and "--cpus 2.5" in start and "--memory 3072m --memory-swap 3072m" in start
    assert "--workdir /app" in start and "--cap-drop ALL" in start
    closed = " ".join(ct.docker_start_argv(_cfg(network="none", drop_capabilities=False), "img", "ep1", env))
    assert "--network none" in closed and "--cap-drop" not in closed and "no-new-privileges" in closed
    assert "--network none" in " ".join(ct.docker_start_argv(cfg, "img", "ep1", Environment(name="t")))
    test = CommandLimits(wall_time_s=1800, cpu_time_s=None, memory_mb=None, max_processes=16)
    exec_ = ct.docker_exec_argv(cfg, "ep1", ["bash", "eval.sh"], False, 1800, limits=test)
    assert exec_[exec_.index("prlimit"):] == ["prlimit", "--nproc=16", "--", "bash", "eval.sh"]
    over = ct.docker_exec_argv(cfg, "ep1", ["x"], False, 9, limits=CommandLimits(9, max_processes=4096))
    assert "--nproc=32" in over  # not above the container's own hard limit (sandbox.max_processes)
    assert exec_[exec_.index("timeout"):exec_.index("prlimit")] == ["timeout", "-s", "KILL", "1800"]
    capped = ct.docker_exec_argv(cfg, "ep1", ["x"], False, 60, limits=CommandLimits(60, 30, 2048, 20))
    assert capped[capped.index("prlimit"):] == ["prlimit", "--cpu=30:31", f"--as={2048 << 20}", "--nproc=20", "--", "x"]
    apptainer = _cfg(backend="apptainer")
    assert "--net" not in ct.apptainer_start_argv(apptainer, "x.sif", "ep1", env)  # the host's network
    assert ct.apptainer_start_argv(apptainer, "x.sif", "ep1", env)[-4:-2] == ["--pwd", "/app"]


def test_podman_command_lines():
    cfg = _cfg(backend="podman", runtime_args=["--runtime", "runc"], max_open_files=512)
    start = ct.docker_start_argv(cfg, "localhost/megathunder-base:k", "ep1")
    assert start[:4] == ["podman", "--runtime", "runc", "run"]
    joined = " ".join(start)
    for flag in ("--network none", "--label megathunder.sandbox=1", "--ulimit nofile=512:512",
                 "--ulimit nproc=64:64", "--memory-swap 512m"):  # fmt: skip
        assert flag in joined
    exec_ = ct.docker_exec_argv(cfg, "ep1", ["ls"], False, 7)
    assert exec_[:5] == ["podman", "--runtime", "runc", "exec", "ep1"]
    sb = ContainerSandbox(cfg, "img")
    assert sb._stop(cfg, "ep1") == ["podman", "--runtime", "runc", "rm", "--force", "--time", "0", "ep1"]


def test_runtime_args_are_for_docker_and_podman_only():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="runtime_args: .* backend apptainer takes its options in extra_args"):
        _cfg(backend="apptainer", runtime_args=["--debug"])


def test_apptainer_and_enroot_command_lines():
    cfg = _cfg(backend="apptainer", workdir="/testbed")
    start = ct.apptainer_start_argv(cfg, "/images/x.sif", "ep1")
    assert start[:3] == ["apptainer", "instance", "start"] and start[-2:] == [
        "/images/x.sif",
        "ep1",
    ]
    assert {"--containall", "--cleanenv", "--net", "--writable-tmpfs"} <= set(start)
    assert start[start.index("--network") + 1] == "none"
    exec_ = ct.apptainer_exec_argv(cfg, "ep1", ["ls"], False, 7)
    assert exec_[:5] == ["apptainer", "exec", "--pwd", "/testbed", "instance://ep1"] and exec_[
        -2:
    ] == ["--", "ls"]
    cfg = _cfg(backend="enroot", extra_args=["--mount", "/data:/data"])
    assert ct.enroot_start_argv(cfg, "/images/x.sqsh", "ep1") == [
        "enroot",
        "create",
        "--name",
        "ep1",
        "/images/x.sqsh",
    ]
    exec_ = ct.enroot_exec_argv(cfg, "ep1", ["ls"], False, 7)
    assert (
        exec_[:6] == ["enroot", "start", "--rw", "--mount", "/data:/data", "ep1"]
        and exec_[-1] == "ls"
    )


def test_missing_cli_image_file_or_image_is_a_clear_error(tmp_path):
    with pytest.raises(SandboxError, match="'no-such-docker' is not on PATH"):
        asyncio.run(build_sandbox(_cfg(cli="no-such-docker"), "img"))
    with pytest.raises(SandboxError, match="needs a container image"):
        asyncio.run(build_sandbox(_cfg(), None))
    with pytest.raises(SandboxError, match=f"apptainer image file not found: {tmp_path}/x.sif"):
        asyncio.run(
            build_sandbox(_cfg(backend="apptainer", cli="true"), str(tmp_path / "x.sif"))
        )
    cli = _fake_cli(tmp_path, fail_run=True)
    with pytest.raises(
        SandboxError,
        match="cannot start docker container from image 'missing:1'.*Unable to find image",
    ):
        asyncio.run(build_sandbox(_cfg(cli=cli), "missing:1"))


_RUN_FAILS = "  run) echo \"Unable to find image '$(eval echo \\${$(($#-1))})' locally\" >&2; exit 125;;\n"


def _fake_cli(tmp_path, fail_run=False) -> str:
    """A stand-in `docker`: logs its arguments; `exec` runs the in-container command on the host."""
    path = tmp_path / "fake-docker"
    path.write_text(
        "#!/bin/sh\n"
        f'echo "$@" >> {tmp_path}/calls.log\n'
        'case "$1" in\n'
        + (_RUN_FAILS if fail_run else "  run) echo 0123abcd; exit 0;;\n")
        + f'  exec) [ -e {tmp_path}/gone ] && {{ echo "Error: no container with name or ID found: no such container" >&2; exit 125; }}\n'
        '        shift\n'
        '        while [ "${1#-}" != "$1" ]; do [ "$1" = --workdir ] && { cd "$2"; shift; }; shift; done\n'
        '        shift; exec "$@";;\n'
        f'  container) [ -e {tmp_path}/gone ] && echo false || echo true; exit 0;;\n'
        "  rm) exit 0;;\n"
        "esac\n"
    )  # fmt: skip
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_lifecycle_through_the_limits_wrapper(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    cfg = _cfg(
        cli=_fake_cli(tmp_path),
        workdir=str(work),
        wall_time_s=1,
        max_output_bytes=4096,
    )

    async def go():
        sb = await build_sandbox(cfg, "python:3.11")
        assert isinstance(sb, ContainerSandbox)
        await sb.upload({"pkg/a.txt": "hello"})
        read = await sb.read_file("pkg/a.txt")
        env = await sb.shell("echo $PYTHONDONTWRITEBYTECODE")
        hung = await sb.shell("sleep 30")
        big = await sb.exec(["python3", "-c", "x = bytearray(1 << 30)"])
        await sb.close()
        return read, env, hung, big

    read, env, hung, big = asyncio.run(go())
    assert read.ok and read.output == "hello" and env.output.strip() == "1"
    # the in-container timeout cut `sleep 30` (the duration bound only shows it did not run out:
    # a loaded machine can take seconds to start and reap the stand-in's processes)
    assert hung.exit_code == 137 and "SIGKILL" in hung.observation() and hung.duration_s < 25
    assert "MemoryError" in big.output and not big.ok  # prlimit --as inside the container
    calls = (tmp_path / "calls.log").read_text().splitlines()
    assert (
        calls[0].startswith("run --detach --rm --name megathunder-")
        and "--network none" in calls[0]
    )
    assert calls[-1].startswith("rm --force megathunder-")
    assert os.path.exists(work / "pkg" / "a.txt")


def test_dataset_instance_episode_through_the_container_backend(tmp_path):
    """A SWE-smith-style record -> its image's container (stand-in CLI) -> scripted episode with
    real tool calls -> the record's test command as the reward."""
    import json

    from megathunder.config import AgentLoopConfig, VerifierConfig
    from megathunder.rollout.agent_loop import AgentLoop
    from megathunder.rollout.scripted import ScriptedPolicy
    from megathunder.rollout.verifiers import VerifierPool
    from megathunder.rollout.tasks.task import tool_call_text
    from megathunder.rollout.tasks.datasets import ContainerTestTask, load_swe_bench
    from tests.rollout_helpers import codec

    testbed = tmp_path / "testbed"  # what the image holds at its work dir
    testbed.mkdir()
    (testbed / "mod.py").write_text("def double(x):\n    return x + x + 1\n")
    (testbed / "test_mod.py").write_text(
        "import unittest\nfrom mod import double\n\n\nclass T(unittest.TestCase):\n"
        "    def test_double(self):\n        self.assertEqual(double(4), 8)\n"
    )
    record = {
        "instance_id": "toy__mod-1", "repo": "toy/mod", "image": "toy/mod:1", "base_commit": "0" * 40,
        "problem_statement": "double(4) returns 9", "FAIL_TO_PASS": ["test_double (test_mod.T.test_double)"],
        "PASS_TO_PASS": [], "log_parser": "parse_log_django", "eval_type": "pass_and_fail",
        "eval_script": "#!/bin/bash\nset -uxo pipefail\n: '>>>>> Start Test Output'\npython3 -m unittest -v test_mod\n"
                       ": '>>>>> End Test Output'\n",
    }  # fmt: skip
    path = tmp_path / "bench.jsonl"
    path.write_text(json.dumps(record) + "\n")
    task = ContainerTestTask("swe_bench", load_swe_bench, str(path))
    (inst,) = task.instances(1)
    assert inst.image == "toy/mod:1" and inst.environment.workdir == "/testbed"
    # the stand-in runs the container's commands on the host: its /testbed is the one made here
    inst = dataclasses.replace(inst, environment=dataclasses.replace(inst.environment, workdir=str(testbed)))
    c = codec()
    sandbox = _cfg(cli=_fake_cli(tmp_path))

    def run(turns):
        policy = ScriptedPolicy(c, {inst.prompt: turns})
        pool = VerifierPool(VerifierConfig(timeout_s=30))
        loop = AgentLoop(policy, c, task, AgentLoopConfig(), sandbox, pool)
        return asyncio.run(loop.run_batch([inst], 1))[0]

    assert run(["I give up."]).reward.reward == 0.0  # the test really fails before the fix
    fix = tool_call_text("str_replace", path="mod.py", old="x + x + 1", new="2 * x")
    ep = run([fix, "Fixed."])
    assert ep.turns[0].tool_runs[0].observation == "replaced 1 occurrence in mod.py"
    assert ep.reward.status == "ok" and ep.reward.reward == 1.0
    calls = (tmp_path / "calls.log").read_text()
    assert "toy/mod:1" in calls and "-- bash /tmp/.megathunder_eval_" in calls  # the test run under its own limits


def test_base_image_key_and_the_sandbox_command_errors(capsys):
    from megathunder.cli import main
    from megathunder.rollout.sandbox import images

    key = images.base_image_key()
    assert key == images.base_image_key(packages=list(reversed(images.DEFAULT_PACKAGES)))
    assert key != images.base_image_key(packages=["python3"]) != images.base_image_key(suite="trixie")
    assert main(["sandbox", "probe", "--cli", "no-such-podman"]) == 2
    assert "megathunder sandbox probe: 'no-such-podman' is not on PATH" in capsys.readouterr().err
    with pytest.raises(SandboxError, match="needs an image"):
        images.probe_runtime("true")


def test_a_container_gone_mid_episode_is_an_infrastructure_failure(tmp_path):
    """A runtime error from `exec` whose container the runtime says is not running raises
    SandboxError (an infrastructure failure), never a failing command; a command's own error is a
    result as before."""
    from megathunder.rollout.verifiers import InfrastructureError

    async def go():
        sb = await build_sandbox(_cfg(cli=_fake_cli(tmp_path), workdir=str(tmp_path)), "img:1")
        (tmp_path / "gone").write_text("")  # removed behind the sandbox's back
        try:
            await sb.shell("true")
        finally:
            await sb.close()

    with pytest.raises(SandboxError, match="sandbox lost: docker container megathunder-.* is not running") as err:
        asyncio.run(go())
    assert isinstance(err.value, InfrastructureError)
    (tmp_path / "gone").unlink()

    async def own_error():
        sb = await build_sandbox(_cfg(cli=_fake_cli(tmp_path), workdir=str(tmp_path)), "img:1")
        try:
            return await sb.shell("echo 'Error: my own' >&2; exit 1")
        finally:
            await sb.close()

    own = asyncio.run(own_error())
    assert own.exit_code == 1 and "Error: my own" in own.output
