"""The container backend under a real runtime: podman from Debian's packages, the Debian base image
built offline by ``megathunder.rollout.sandbox.images`` (debootstrap -> ``podman import``, once per
machine: its tag is a content key), task images ``FROM`` it.

What is shown: a real SWE-style episode (bash / read / edit tools, the test suite as the reward)
in a container; no network; the memory limit (one allocation beyond it fails, several processes
summing beyond it are OOM-killed and reported so); the pids limit; 64 parallel episodes with
timeouts, killed commands, exceptions and cancellations mixed in leave no container behind.
Skipped, with the reason, where podman or debootstrap is missing or no container can run.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import threading
import time

import pytest

from megathunder.config import AgentLoopConfig, ContainerSandboxConfig, VerifierConfig
from megathunder.rollout.agent_loop import AgentLoop
from megathunder.rollout.sandbox import ContainerSandbox, SandboxError, build_sandbox
from megathunder.rollout.sandbox import images
from megathunder.rollout.scripted import ScriptedPolicy
from megathunder.rollout.tasks.swe_local import TEST_COMMAND, SweLocalTask
from megathunder.rollout.verifiers import VerifierPool
from tests.rollout_helpers import codec


@pytest.fixture(scope="session")
def podman():
    """(base image tag, runtime_args); built once per session (a no-op when it exists). Skipped
    with the reason where podman cannot run -- except under tools/test.sh as root, which installs
    it (MEGATHUNDER_REQUIRE_PODMAN=1): there a missing or broken runtime fails."""
    unavailable = pytest.fail if os.environ.get("MEGATHUNDER_REQUIRE_PODMAN") == "1" else pytest.skip
    if shutil.which("podman") is None:
        unavailable("podman not installed (tools/test.sh installs it as root: apt-get install podman)")
    tag = f"{images.BASE_REPOSITORY}:{images.base_image_key()}"
    if not images.image_exists(tag) and (shutil.which("debootstrap") is None or os.geteuid() != 0):
        unavailable("no base image and no way to build one (needs root and debootstrap)")
    try:
        base = images.build_base_image()
        runtime_args = images.probe_runtime(image=base.tag)
    except SandboxError as err:
        unavailable(f"no container runtime works here: {err}")
    return base.tag, runtime_args


def _cfg(podman, **kw) -> ContainerSandboxConfig:
    tag, runtime_args = podman
    fields = {"backend": "podman", "image": tag, "runtime_args": runtime_args,
              "wall_time_s": 20, "cpu_time_s": 10, "memory_mb": 256, "max_processes": 32, **kw}  # fmt: skip
    return ContainerSandboxConfig(**fields)


def _ours(names) -> list[str]:
    """Of the given container names, those podman still lists (running or stopped)."""
    left = set(images.leftover_containers())
    return sorted(n for n in names if n in left)


def test_swe_episode_in_a_container(podman):
    task = SweLocalTask()
    insts = task.instances(2, seed=3)
    c = codec()

    def run(scripts):
        policy = ScriptedPolicy(c, scripts)
        loop = AgentLoop(
            policy, c, task, AgentLoopConfig(max_total_tokens=8192, max_new_tokens_per_turn=1024),
            _cfg(podman), VerifierPool(VerifierConfig(timeout_s=60)),
        )  # fmt: skip
        return asyncio.run(loop.run_batch(insts, 1))

    for inst, ep in zip(insts, run({i.prompt: task.scripted_turns(i) for i in insts}), strict=True):
        assert ep.failure is None and ep.reward.reward == 1.0, ep.failure
        runs = [r for turn in ep.turns for r in turn.tool_runs]
        assert [r.name for r in runs] == ["read_file", "bash", "str_replace", "bash"]
        assert inst.metadata["bug"] in runs[0].observation  # read inside the container
        assert runs[3].observation.rstrip().endswith("OK")  # the visible tests (the bug's are hidden: F2P)
    unfixed = run({i.prompt: ["I give up."] for i in insts})
    assert [ep.reward.reward for ep in unfixed] == [0.0, 0.0]  # the test really fails unfixed


def test_task_image_built_from_the_base(podman):
    """A task environment ``FROM`` the base image with its repository in the image (nothing
    uploaded by the episode), as a SWE-bench or Terminal-Bench instance image is used."""
    tag, runtime_args = podman
    task_tag = images.build_image(
        "localhost/megathunder-test-task:1",
        f"FROM {tag}\nCOPY repo /workspace\nRUN cd /workspace && git init -q && git add -A && "
        "git -c user.name=t -c user.email=t@t commit -qm base\n",  # a RUN step runs offline too
        {"repo/mod.py": "def double(x):\n    return x + x + 1\n",
         "repo/test_mod.py": "import unittest\nfrom mod import double\n\n\nclass T(unittest.TestCase):\n"
                             "    def test_double(self):\n        self.assertEqual(double(4), 8)\n"},
        runtime_args=runtime_args,
    )  # fmt: skip

    async def go():
        sb = await build_sandbox(_cfg(podman), task_tag)
        try:
            before = await sb.shell("python3 -m unittest -q test_mod")
            await sb.write_file("mod.py", "def double(x):\n    return 2 * x\n")
            after = await sb.shell("python3 -m unittest -q test_mod && git status --short")
            return before, after
        finally:
            await sb.close()

    try:
        before, after = asyncio.run(go())
    finally:
        subprocess.run(["podman", *runtime_args, "rmi", "-f", task_tag], capture_output=True, timeout=120)
    assert not before.ok and "AssertionError: 9 != 8" in before.output
    status = [line for line in after.output.splitlines() if line[:3] in (" M ", "?? ", "A  ")]
    assert after.ok and status == [" M mod.py"]  # the image's repository, one file edited


def test_no_network_and_resource_limits(podman):
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    accepted: list = []
    threading.Thread(target=lambda: accepted.append(server.accept()), daemon=True).start()
    probe = (
        "import socket\n"
        f"for addr in [('127.0.0.1', {port}), ('1.1.1.1', 53), ('10.0.2.2', 80)]:\n"
        "    s = socket.socket(); s.settimeout(2)\n"
        "    try: s.connect(addr); print('CONNECTED', addr)\n"
        "    except OSError as e: print('refused', addr, e)\n"
    )
    # Two processes of 160 MiB each: each within the per-process address-space limit (256 MiB),
    # together beyond the container's 256 MiB cgroup: the kernel's OOM killer ends one.
    two = (
        "import os, time\npid = os.fork()\nx = bytearray(160 << 20)\n"
        "for i in range(0, len(x), 4096): x[i] = 1\n"
        "time.sleep(5)\nif pid:\n    st = os.waitpid(pid, 0)[1]\n"
        "    if os.WIFSIGNALED(st): os.kill(os.getpid(), os.WTERMSIG(st))\n"
    )  # whichever of the two the kernel kills, the command dies of SIGKILL (as a shell would report)
    counter = (
        "import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
        "            time.sleep(30); os._exit(0)\n        n += 1\n"
        "except OSError as e:\n    print('forks', n, e)\n"
    )

    async def go():
        sb = await build_sandbox(_cfg(podman, max_processes=16))
        assert isinstance(sb, ContainerSandbox)
        try:
            net = await sb.exec(["python3", "-c", probe])
            big = await sb.exec(["python3", "-c", "x = bytearray(1 << 30)"])
            start = time.monotonic()
            oom = await sb.exec(["python3", "-c", two])
            oom_s = time.monotonic() - start
            after = await sb.shell("echo alive")
            forks = await sb.exec(["python3", "-c", counter])
            return net, big, oom, oom_s, after, forks, sb.name
        finally:
            await sb.close()

    net, big, oom, oom_s, after, forks, name = asyncio.run(go())
    server.close()
    assert "CONNECTED" not in net.output and not accepted
    assert sum(line.startswith("refused") for line in net.output.splitlines()) == 3
    assert "MemoryError" in big.output and not big.ok  # one allocation beyond: the rlimit
    assert oom.oom_killed and "memory limit of 256 MiB" in oom.error(), oom
    assert oom_s < 20  # killed, not hung until the 20 s wall-time limit
    assert after.ok  # the sandbox survives an OOM kill of one command
    assert 0 < int(forks.output.split()[1]) < 16 and "Resource temporarily unavailable" in forks.output
    assert _ours([name]) == []
    print(f"OOM kill reported after {oom_s:.1f} s (wall-time limit 20 s)")


def test_64_episodes_with_faults_leave_no_container(podman):
    """64 episodes, 16 at a time: one in five each hits the wall-time limit, kills its own command,
    raises mid-episode, or is cancelled while a command runs (whose process in the container is
    killed with it: a loop writing a file stops writing); the rest finish. No container may be left, and
    the healthy ones see only their own files."""
    cfg = _cfg(podman)  # 20 s per command; the timeout fault sets its own 2 s
    slots = asyncio.Semaphore(16)
    names: list[str] = []

    class Boom(RuntimeError):
        pass

    async def episode(k: int) -> str:
        async with slots:
            sb = await build_sandbox(cfg)
            assert isinstance(sb, ContainerSandbox)
            names.append(sb.name)
            try:
                await sb.write_file("id.txt", str(k))
                fault = k % 5
                if fault == 0:
                    r = await sb.shell("sleep 30", timeout_s=2)
                    # cut by the in-container `timeout` (SIGKILL), or, where `podman exec` is slow
                    # on a loaded host, by the host-side backstop 5 s later: both the limit
                    cut = r.timed_out or (r.exit_code == 137 and not r.oom_killed)
                    return "timeout" if cut and r.duration_s < 30 else f"bad {r}"
                if fault == 1:
                    r = await sb.shell("kill -9 $$")
                    return "killed" if r.exit_code == 137 else f"bad {r}"
                if fault == 2:
                    raise Boom(k)
                if fault == 3:  # once the cancelled exec returns, its command runs no more
                    loop = "while :; do date +%s%N > tick; sleep 0.05; done"
                    job = asyncio.ensure_future(sb.shell(loop))
                    await asyncio.sleep(0.5)
                    job.cancel()
                    await asyncio.gather(job, return_exceptions=True)
                    first = await sb.shell("cat tick 2>/dev/null; echo .")
                    await asyncio.sleep(0.5)
                    again = await sb.shell("cat tick 2>/dev/null; echo .")
                    same = first.ok and first.output == again.output
                    return "cancelled" if same else f"bad {first} {again}"
                r = await sb.shell("cat id.txt; echo; ls")
                return "ok" if r.ok and r.output.split() == [str(k), "id.txt"] else f"bad {r}"
            finally:
                await sb.close()

    async def go():
        start = time.monotonic()
        results = await asyncio.gather(*(episode(k) for k in range(64)), return_exceptions=True)
        return results, time.monotonic() - start

    results, elapsed = asyncio.run(go())
    outcomes = [type(r).__name__ if isinstance(r, BaseException) else r for r in results]
    expected = {0: "timeout", 1: "killed", 2: "Boom", 3: "cancelled", 4: "ok"}
    assert outcomes == [expected[k % 5] for k in range(64)]
    assert len(names) == 64 and _ours(names) == []
    print(f"64 episodes with faults, 16 at a time: {elapsed:.1f} s")


def test_terminal_bench_and_harbor_task_directories_build_their_environment_and_score(podman, tmp_path):
    """Task directories as Terminal-Bench 1 and Harbor ship them: each task's own Dockerfile (``FROM``
    the local base image: nothing can be pulled here) is built once when its first episode starts,
    the agent works in that image at its WORKDIR (/app, not the sandbox's default), the tests are
    copied in after the episode and the task's own test script scores it (Terminal-Bench 1: its
    pytest summary; Harbor: its reward file)."""
    from megathunder.rollout.tasks.terminal_bench import TerminalBenchTask

    tag, _ = podman
    tasks = tmp_path / "tasks"
    tb1, harbor = tasks / "hello-tb1", tasks / "hello-harbor"
    (tb1 / "tests").mkdir(parents=True)
    (tb1 / "task.yaml").write_text("instruction: |\n  Write hello into greeting.txt.\nmax_test_timeout_sec: 20\n")
    (tb1 / "Dockerfile").write_text(f"FROM {tag}\nWORKDIR /app\nCOPY seed.txt /app/\n")
    (tb1 / "seed.txt").write_text("seed\n")
    (tb1 / "run-tests.sh").write_text(  # pytest's -rA summary, which Terminal-Bench 1's parser reads, written by bash
        "echo '=========================== short test summary info ============================'\n"
        'if [ "$(cat greeting.txt)" = "$(cat "$TEST_DIR/expected.txt")" ]; then echo PASSED test_outputs.py::test_hello; '
        "else echo FAILED test_outputs.py::test_hello; fi\n")
    (tb1 / "tests" / "expected.txt").write_text("hello\n")
    (tb1 / "solution.sh").write_text("echo hello > greeting.txt\n")
    for sub in ("environment", "tests", "solution"):
        (harbor / sub).mkdir(parents=True)
    (harbor / "task.toml").write_text('version = "1.0"\n[verifier]\ntimeout_sec = 30.0\n')
    (harbor / "instruction.md").write_text("# Greeting\nWrite hi into greeting.txt.\n")
    (harbor / "environment" / "Dockerfile").write_text(f"FROM {tag}\nWORKDIR /app\nCOPY data.txt /app/\n")
    (harbor / "environment" / "data.txt").write_text("data\n")
    (harbor / "tests" / "test.sh").write_text(
        'if [ "$(cat greeting.txt)" = "$(cat /tests/expected.txt)" ]; then echo 1 > /logs/verifier/reward.txt; '
        'else echo 0 > /logs/verifier/reward.txt; fi\n')
    (harbor / "tests" / "expected.txt").write_text("hi\n")
    (harbor / "solution" / "solve.sh").write_text("echo hi > greeting.txt\n")
    task = TerminalBenchTask(str(tasks))
    insts = task.instances(2)
    built = [i.image for i in insts]
    c = codec()

    def run(scripts):
        loop = AgentLoop(ScriptedPolicy(c, scripts), c, task,
                         AgentLoopConfig(max_total_tokens=8192, max_new_tokens_per_turn=1024),
                         _cfg(podman, drop_capabilities=False),  # as Docker runs them: root writes /solution
                         VerifierPool(VerifierConfig(timeout_s=60)))
        return asyncio.run(loop.run_batch(insts, 2))

    try:
        solved = run({i.prompt: task.scripted_turns(i) for i in insts})
        assert [ep.reward.reward for ep in solved] == [1.0] * 4, [ep.failure for ep in solved]
        assert all(images.image_exists(t) for t in built)  # built from the task's own Dockerfile
        unsolved = run({i.prompt: ["Done."] for i in insts})
        assert [ep.reward.reward for ep in unsolved] == [0.0] * 4
    finally:
        for t in built:
            subprocess.run(["podman", "rmi", "-f", t], capture_output=True, timeout=120)


def test_a_podman_sandbox_server_runs_sandboxes_and_its_successor_removes_what_a_killed_one_left(podman, tmp_path,
                                                                                                 monkeypatch):
    """``megathunder sandbox serve`` with the podman runtime: a sandbox made through the remote
    backend is a container labelled with its server's key; the server SIGKILLed leaves that
    container running (its ``sleep`` keeps it alive); the next server started at the same node and
    port removes it by its record before it serves, and one stopped by SIGTERM leaves nothing."""
    import signal
    import sys

    import yaml

    from megathunder.config import RemoteSandboxConfig
    from megathunder.rollout.sandbox import close_sandbox_pools
    from megathunder.rollout.sandbox.leftovers import SERVER_LABEL

    tag, runtime_args = podman
    monkeypatch.setenv("MT_TEST_SANDBOX_KEY", "s3cret")  # the servers' secret (the client sends it)
    sandbox = {"backend": "remote", "api_key_env": "MT_TEST_SANDBOX_KEY", "state_dir": str(tmp_path / "state"),
               "max_sandboxes_per_server": 4,
               "runtime": {"backend": "podman", "image": tag, "runtime_args": runtime_args, "wall_time_s": 20,
                           "cpu_time_s": 10, "memory_mb": 256, "max_processes": 32}}
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump({"sandbox": sandbox}))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url, key = f"http://127.0.0.1:{port}", f"{socket.gethostname()}-{port}"

    def serve(log: str) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-m", "megathunder.cli", "sandbox", "serve", str(config),
                                 "--port", str(port)], stdout=(tmp_path / log).open("w"), stderr=subprocess.STDOUT,
                                start_new_session=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / log).read_text()
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    return proc
            except OSError:
                time.sleep(0.2)
        raise AssertionError((tmp_path / log).read_text())

    def labelled() -> list[str]:
        out = subprocess.run(["podman", *runtime_args, "ps", "-a", "--filter", f"label={SERVER_LABEL}={key}",
                              "--format", "{{.Names}}"], capture_output=True, text=True, check=True, timeout=60)
        return out.stdout.split()

    first = serve("first.log")
    try:
        async def one_sandbox():
            client = RemoteSandboxConfig.model_validate({**sandbox, "server_urls": [url]})
            sb = await build_sandbox(client)
            try:
                return await sb.exec(["sh", "-c", "echo in a container; cat /etc/debian_version > /dev/null"])
            finally:
                await close_sandbox_pools()  # the sandbox left open: its server is killed next

        result = asyncio.run(one_sandbox())
        assert result.ok and result.output == "in a container\n", result
        assert len(labelled()) == 1  # the server's own container, found by its label
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(10)
        assert len(labelled()) == 1  # a killed server cannot destroy it
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    second = serve("second.log")
    try:
        assert labelled() == [], (tmp_path / "second.log").read_text()
        assert "removed 1 left by an earlier server" in (tmp_path / "second.log").read_text()
    finally:
        second.send_signal(signal.SIGTERM)
        assert second.wait(60) == 0, (tmp_path / "second.log").read_text()
    assert labelled() == []
