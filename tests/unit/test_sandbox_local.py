"""The local sandbox's bookkeeping: files in and out, per-sandbox uids, sandboxes isolated from
each other, and the error texts the model sees."""

from __future__ import annotations

import asyncio
import os

import pytest

from megathunder.rollout.sandbox import ExecResult, LocalSandbox, SandboxError
from megathunder.rollout.sandbox.local import _UidPool
from tests.rollout_helpers import ISOLATIONS, needs_root, sandbox_cfg


@needs_root
@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_files_roundtrip_and_sandboxes_cannot_see_each_other(isolation, tmp_path):
    async def go():
        a = LocalSandbox(sandbox_cfg(tmp_path, isolation=isolation))
        b = LocalSandbox(sandbox_cfg(tmp_path, isolation=isolation))
        try:
            await a.upload({"src/secret.txt": "s3cret\n", "bin.dat": b"\x00\xff"})
            wrote = await a.write_file("deep/new/file.py", "print('hi')\n")
            read = await a.read_file("src/secret.txt")
            run = await a.exec(["python3", "deep/new/file.py"])
            peek = await b.shell(
                f"cat {a.host_dir}/src/secret.txt; ls {os.path.dirname(a.host_dir)}"
            )
            return a.uid, b.uid, wrote, read, run, peek
        finally:
            await a.close()
            await b.close()

    uid_a, uid_b, wrote, read, run, peek = asyncio.run(go())
    assert uid_a != uid_b and uid_a >= 200_000
    assert wrote.ok and read.output == "s3cret\n" and run.output == "hi\n"
    assert "s3cret" not in peek.output and not peek.ok


def test_uid_pool_is_distinct_and_bounded():
    pool = _UidPool()
    uids = {pool.take(1000, 3) for _ in range(3)}
    assert len(uids) == 3 and uids <= {1000, 1001, 1002}
    with pytest.raises(SandboxError, match="all 3 sandbox uids from 1000 are in use"):
        pool.take(1000, 3)
    pool.give(1001)
    assert pool.take(1000, 3) == 1001


@needs_root
def test_unreachable_root_dir_is_a_clear_error(tmp_path):
    hidden = tmp_path / "private"
    hidden.mkdir(mode=0o700)
    cfg = sandbox_cfg(tmp_path).model_copy(update={"root_dir": str(hidden / "sbx")})
    with pytest.raises(SandboxError, match="private is not traversable by other users"):
        LocalSandbox(cfg)


@pytest.mark.parametrize(
    ("result", "error"),
    [
        (ExecResult(0, "ok", 0.1), None),
        (ExecResult(2, "", 0.1), "command failed with exit code 2"),
        (
            ExecResult(None, "", 3.0, timed_out=True, wall_limit_s=3),
            "wall-time limit of 3 s exceeded",
        ),
        (ExecResult(152, "", 1.0, cpu_limit_s=1), "signal SIGXCPU: CPU-time limit of 1 s exceeded"),
        (ExecResult(137, "", 1.0), "signal SIGKILL: killed (memory or process limit"),
        (ExecResult(139, "", 1.0), "signal SIGSEGV: segmentation fault"),
    ],
)
def test_error_texts(result, error):
    assert (result.error() is None) == (error is None)
    if error:
        assert error in result.error() and result.observation().endswith(
            f"[error: {result.error()}]"
        )
    else:
        assert result.observation() == "ok"


@needs_root
@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_cgroup_bounds_memory_of_the_whole_tree(isolation, tmp_path):
    """Four processes of 100 MiB each pass the 192 MiB per-process limit; the sandbox's cgroup
    stops their sum. Without a cgroup this would take 400 MiB."""
    from megathunder.rollout.sandbox.cgroups import create_cgroup

    probe = create_cgroup("auto", 1 << 30, 16)
    if probe is None:
        pytest.skip("no writable cgroup hierarchy with memory and pids controllers")
    probe.remove()
    hog = "python3 -c \"import time; x = b'1' * (100 << 20); time.sleep(1)\""

    async def go():
        sb = LocalSandbox(
            sandbox_cfg(tmp_path, isolation=isolation, cgroup="required", memory_mb=192)
        )
        dirs = list(sb.cgroup.dirs.values())
        try:
            single = await sb.shell(hog.replace("time.sleep(1)", "print('one ok')"))
            many = await sb.shell(" & ".join([hog] * 4) + " & wait")
            return single, many, dirs
        finally:
            await sb.close()

    single, many, dirs = asyncio.run(go())
    assert single.ok and "one ok" in single.output
    assert many.oom_killed and "memory limit of 192 MiB was exceeded" in many.observation()
    assert not any(os.path.exists(d) for d in dirs)  # removed on close


@needs_root
def test_str_replace_edits_files_past_the_output_limit(tmp_path):
    from megathunder.rollout.tools import STR_REPLACE

    big = "".join(f"line {k}\n" for k in range(5000)) + "MARKER = 1\n"

    async def go():
        sb = LocalSandbox(sandbox_cfg(tmp_path, max_output_bytes=1024))
        try:
            await sb.upload({"big.py": big})
            shown = await sb.read_file("big.py")
            args = {"path": "big.py", "old": "MARKER = 1", "new": "MARKER = 2"}
            edit = await STR_REPLACE.run(sb, args)
            again = await STR_REPLACE.run(sb, args)
            tail = await sb.shell("tail -n 1 big.py; wc -c < big.py")
            return shown, edit, again, tail
        finally:
            await sb.close()

    shown, edit, again, tail = asyncio.run(go())
    assert shown.output_truncated and len(shown.output) == 1024  # what the model sees is capped
    assert edit == "replaced 1 occurrence in big.py"
    assert again.startswith("[error: the text to replace occurs 0 times")
    assert tail.output.split() == ["MARKER", "=", "2", str(len(big))]


@needs_root
@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_host_environment_does_not_reach_the_sandbox(isolation, tmp_path, monkeypatch):
    """Found in CI: once vLLM's CPU build is imported it sets LD_PRELOAD to a host library, which
    the launcher's shell inside the namespaces could not open (an ld.so error in every output).
    Neither that nor any host variable (a secret, say) may reach the sandbox."""
    import torch

    libgomp = os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp.so.1")
    if os.path.exists(libgomp):
        monkeypatch.setenv("LD_PRELOAD", libgomp)
    monkeypatch.setenv("MEGATHUNDER_TEST_SECRET", "hunter2")

    async def go():
        box = LocalSandbox(sandbox_cfg(tmp_path, isolation=isolation))
        try:
            return await box.shell("echo hi; env")
        finally:
            await box.close()

    result = asyncio.run(go())
    assert result.ok and result.output.startswith("hi\n"), result.output
    assert "ld.so" not in result.output and "hunter2" not in result.output
    assert "LD_PRELOAD" not in result.output


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_rootless_sandbox_runs_as_the_user_in_its_own_root(isolation, tmp_path):
    """As an ordinary user: no uid switch and no cgroup, work dirs under ``<root_dir>-<uid>``,
    files round-trip, and one sandbox still cannot see another's files."""
    from tests.sandbox_users import ordinary_user, run_as

    def body():
        async def go():
            a = LocalSandbox(sandbox_cfg(tmp_path, isolation=isolation))
            b = LocalSandbox(sandbox_cfg(tmp_path, isolation=isolation))
            try:
                await a.upload({"src/secret.txt": "s3cret\n"})
                read = await a.read_file("src/secret.txt")
                who = await a.shell("id -u")
                peek = await b.shell(f"cat {a.host_dir}/src/secret.txt; ls {a.root_dir}")
                return (a.rootless, a.uid, a.root_dir, a.host_dir, a.cgroup, read.output,
                        who.output.strip(), peek.output, a.contained_uid)  # fmt: skip
            finally:
                await a.close()
                await b.close()

        return asyncio.run(go())

    uid, gid = (os.getuid(), os.getgid()) if os.geteuid() != 0 else ordinary_user()
    got = body() if os.geteuid() != 0 else run_as(uid, gid, body)
    rootless, sb_uid, root_dir, host_dir, cgroup, read, who, peek, contained = got
    assert rootless and sb_uid == uid and cgroup is None
    assert root_dir == f"/tmp/megathunder-test-sandboxes-{uid}" and host_dir.startswith(root_dir + "/")
    assert read == "s3cret\n" and who == str(contained) and "s3cret" not in peek
    assert not os.path.exists(host_dir)  # removed on close


@needs_root
def test_rootless_root_dir_of_another_user_is_a_clear_error(tmp_path):
    from tests.sandbox_users import ordinary_user, run_as

    uid, gid = ordinary_user()
    taken = "/tmp/megathunder-test-taken"
    os.makedirs(f"{taken}-{uid}", exist_ok=True)  # made by root: not the user's own
    cfg = sandbox_cfg(tmp_path).model_copy(update={"root_dir": taken})

    def body():
        try:
            LocalSandbox(cfg)
        except SandboxError as err:
            return str(err)
        return "no error"

    try:
        msg = run_as(uid, gid, body)
    finally:
        os.rmdir(f"{taken}-{uid}")
    assert f"sandbox.root_dir: {taken}-{uid} (the rootless work-dir root) belongs to uid 0" in msg


@needs_root
def test_a_task_s_paths_and_a_test_run_s_limits(tmp_path):
    """A task's environment is laid out at its own paths under bwrap (the work dir at its WORKDIR,
    the harness's scratch dirs writable and kept between commands, private to the episode), and a
    command with a test run's own limits runs under those, not the agent's tool limits."""
    import asyncio

    from megathunder.rollout.sandbox import CommandLimits, Environment, LocalLayout

    env = Environment(name="t", local=LocalLayout(workdir="/app"), scratch_dirs=("/tests", "/logs"))
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 1.5: pass\nprint('done')"

    async def go():
        cfg = sandbox_cfg(tmp_path, cpu_time_s=1, wall_time_s=30)
        a, b = LocalSandbox(cfg, env), LocalSandbox(cfg, env)
        try:
            made = await a.bash("pwd; mkdir -p /logs/verifier && echo 1 > /logs/verifier/reward.txt && echo t > /tests/x")
            kept = await a.bash("cat /logs/verifier/reward.txt /tests/x")
            other = await b.bash("ls /tests /logs")
            agent = await a.exec(["python3", "-c", burn])
            test = await a.exec(["python3", "-c", burn], limits=CommandLimits(wall_time_s=60, cpu_time_s=None))
            return made, kept, other, agent, test
        finally:
            await a.close()
            await b.close()

    made, kept, other, agent, test = asyncio.run(go())
    assert made.ok and made.output.splitlines()[0] == "/app"
    assert kept.output.split() == ["1", "t"] and other.ok and other.output.split() == ["/logs:", "/tests:"]
    assert "SIGXCPU" in agent.observation()  # the agent's tool limit: 1 s of CPU
    assert test.ok and test.output.strip() == "done" and test.cpu_limit_s is None
