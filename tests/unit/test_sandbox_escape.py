"""Escape attempts against the local sandbox, under both isolation mechanisms, each run as root and
as an ordinary user (the rootless sandbox: ``tests/sandbox_users.py``). Each one must end within
its limit with an error observation, and leave nothing behind on the host."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time

import pytest

from megathunder.rollout.sandbox import LocalSandbox
from tests.rollout_helpers import ISOLATIONS, sandbox_cfg
from tests.sandbox_users import both_users

pytestmark = [pytest.mark.parametrize("isolation", ISOLATIONS)]


def _processes_of(uid: int) -> list[int]:
    """Live (non-zombie) processes of a uid. A reparented, already dead launcher may linger as a
    zombie until the host's init reaps it; it runs nothing."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid != uid:
                    continue
                with open(f"/proc/{entry}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
            if state != "Z":
                pids.append(int(entry))
    return pids


def _run(isolation, tmp_path, command, **limits):
    async def go():
        sb = LocalSandbox(sandbox_cfg(tmp_path, isolation=isolation, **limits))
        # rootless, the sandbox's uid is this process's own: only new processes are leftovers
        before = set(_processes_of(sb.uid)) | {os.getpid()}
        try:
            start = time.monotonic()
            result = await sb.shell(command(sb) if callable(command) else command)
            elapsed = time.monotonic() - start
            await asyncio.sleep(0.2)  # the pid namespace's teardown is asynchronous
            leftover = [p for p in _processes_of(sb.uid) if p not in before]
            return result, elapsed, leftover, sb
        finally:
            await sb.close()

    return asyncio.run(go())


@both_users
def test_network_is_unreachable(isolation, tmp_path):
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    accepted = []
    threading.Thread(target=lambda: accepted.append(server.accept()), daemon=True).start()
    probe = (
        "import socket\n"
        "for addr in [('127.0.0.1', PORT), ('1.1.1.1', 53), ('8.8.8.8', 443)]:\n"
        "    s = socket.socket(); s.settimeout(2)\n"
        "    try: s.connect(addr); print('CONNECTED', addr)\n"
        "    except OSError as e: print('refused', addr, e)\n"
        "import urllib.request\n"
        "urllib.request.urlopen('http://pypi.org', timeout=2)\n"
    ).replace("PORT", str(port))
    result, elapsed, leftover, _ = _run(isolation, tmp_path, f'python3 -c "{probe}"')
    server.close()
    assert "CONNECTED" not in result.output and not accepted  # not even the host's loopback
    assert sum(line.startswith("refused") for line in result.output.splitlines()) == 3
    assert result.error() is not None and "URLError" in result.output  # no DNS, no route
    assert elapsed < 10 and not leftover


@both_users
def test_cannot_write_outside_work_dir(isolation, tmp_path):
    shared = tmp_path / "world_writable"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    fixed = [
        str(shared / "x"),
        "/etc/megathunder_escape",
        "/root/x",
        "/dev/shm/megathunder_x",
        "/tmp/megathunder_x",
    ]
    targets = []

    def command(
        sb,
    ):  # also the sandbox root (the work dir's parent) and a sibling path, on the host
        root = os.path.dirname(sb.host_dir)
        targets[:] = fixed + [f"{root}/x", f"{sb.host_dir}-sibling", f"{root}/escape"]
        writes = "; ".join(f"echo pwned > {t}" for t in targets[:-1])
        return (
            writes
            + "; echo pwned > ../escape; ln -s /etc/megathunder_link link; echo pwned > link"
        )

    result, _, leftover, sb = _run(isolation, tmp_path, command)
    for t in targets + ["/etc/megathunder_link"]:
        assert not os.path.exists(t), f"sandbox wrote {t}"
    assert result.error() is not None
    assert "Read-only file system" in result.output or "Permission denied" in result.output
    assert not leftover


@both_users
def test_symlink_cannot_redirect_file_tools(isolation, tmp_path):
    async def go():
        sb = LocalSandbox(sandbox_cfg(tmp_path, isolation=isolation))
        try:
            await sb.shell("ln -s /etc/megathunder_via_tool evil")
            return await sb.write_file("evil", "pwned")  # the write happens inside the sandbox
        finally:
            await sb.close()

    result = asyncio.run(go())
    assert not os.path.exists("/etc/megathunder_via_tool")
    assert not result.ok and result.error() is not None


@both_users
def test_fork_bomb_is_contained(isolation, tmp_path):
    bomb = "bash -c ':(){ :|:& };:'; sleep 1"  # the bomb keeps forking while the sandbox lives
    result, elapsed, leftover, _ = _run(isolation, tmp_path, bomb, wall_time_s=3, max_processes=16)
    assert elapsed < 3 + 5  # wall-time limit, plus slack for a loaded machine
    assert "Resource temporarily unavailable" in result.output or result.timed_out
    assert not leftover, "fork bomb processes survived the sandbox"

    counter = (
        "import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
        "            time.sleep(30); os._exit(0)\n        n += 1\n"
        "except OSError as e:\n    print('forks', n, e)\nraise SystemExit(1)"
    )
    result, elapsed, leftover, _ = _run(
        isolation, tmp_path, f'python3 -c "{counter}"', max_processes=16
    )
    forks = int(result.output.split()[1])
    assert 0 < forks < 16 and "Resource temporarily unavailable" in result.output
    assert result.error() is not None and elapsed < 10 and not leftover


@both_users
def test_memory_blow_up_fails(isolation, tmp_path):
    result, elapsed, leftover, _ = _run(
        isolation, tmp_path, "python3 -c 'x = bytearray(2 << 30); print(len(x))'", memory_mb=256
    )
    assert "MemoryError" in result.output and result.error() is not None
    assert elapsed < 10 and not leftover


@both_users
def test_cpu_bound_infinite_loop_hits_cpu_limit(isolation, tmp_path):
    # A wide wall-time limit: on a loaded machine 1 s of CPU can take several seconds of wall time.
    result, elapsed, leftover, _ = _run(
        isolation, tmp_path, "while :; do :; done", cpu_time_s=1, wall_time_s=30
    )
    assert not result.timed_out and "CPU-time limit of 1 s exceeded" in result.error()
    assert elapsed < 30 and not leftover


@both_users
def test_hung_command_hits_wall_time_limit(isolation, tmp_path):
    result, elapsed, leftover, _ = _run(
        isolation, tmp_path, "sleep 1000 & sleep 1000", wall_time_s=1
    )
    assert result.timed_out and "wall-time limit of 1 s" in result.observation()
    assert elapsed < 30 and not leftover  # cut at 1 s, not 1000 s


@both_users
def test_output_flood_is_truncated(isolation, tmp_path):
    result, _, leftover, _ = _run(
        isolation, tmp_path, "yes | head -c 5000000", max_output_bytes=1000
    )
    assert result.ok and len(result.output) == 1000 and result.output_truncated
    assert result.observation().endswith("[output truncated]") and not leftover


@both_users
def test_host_files_are_unreadable(isolation, tmp_path):
    """Root-only host files (a private key, /etc/shadow, /root) cannot be read; under bwrap no
    host path outside the read-only system directories is visible at all. (Under unshare the
    host tree stays visible read-only, so world-readable host files are: RELIABILITY.md.)"""
    import tempfile

    host = tempfile.mkdtemp(prefix="megathunder-host-", dir="/tmp")
    os.chmod(host, 0o755)
    private, public = os.path.join(host, "id_rsa"), os.path.join(host, "public.txt")
    for path, mode in ((private, 0o600), (public, 0o644)):
        with open(path, "w") as f:
            f.write("HOST-SECRET-41\n")
        os.chmod(path, mode)
    try:
        result, _, leftover, _ = _run(
            isolation, tmp_path,
            f"cat {private}; cat /etc/shadow | head -c 100; ls /root; cat {public}; echo END",
        )  # fmt: skip
    finally:
        import shutil

        shutil.rmtree(host)
    out = result.output
    assert out.rstrip().endswith("END") and not leftover
    assert "root:" not in out and ("Permission denied" in out or "No such file" in out)
    if isolation == "bwrap":
        assert "HOST-SECRET-41" not in out and "No such file" in out
    elif os.geteuid() != 0:  # rootless unshare runs as the files' owner: RELIABILITY.md
        assert out.count("HOST-SECRET-41") == 2
    else:
        assert out.count("HOST-SECRET-41") <= 1 and f"{private}: Permission denied" in out


@both_users
def test_host_processes_are_invisible_and_unkillable(isolation, tmp_path):
    """The sandbox's /proc shows its own pid namespace: no host process, its command line or
    environment; signalling a host pid fails."""
    import subprocess

    marker = subprocess.Popen(
        ["sh", "-c", "sleep 60; :", "megathunder-marker-proc"],  # not the interpreter: an
        # ordinary user cannot run it from below /root
        env={**os.environ, "MEGATHUNDER_MARKER_SECRET": "hunter3"},
    )
    try:
        probe = (
            "ls /proc | grep -c '^[0-9]'; "
            "for p in /proc/[0-9]*; do cat $p/cmdline $p/environ 2>/dev/null; done | tr '\\0' ' '; "
            f"echo; kill -9 {marker.pid} && echo KIL''LED; echo END"
        )
        result, _, leftover, _ = _run(isolation, tmp_path, probe)
        alive = marker.poll() is None
    finally:
        marker.kill()
        marker.wait()
    out = result.output
    assert out.rstrip().endswith("END") and not leftover
    assert int(out.split()[0]) < 10  # a handful of the sandbox's own processes
    assert "megathunder-marker-proc" not in out and "hunter3" not in out
    assert "KILLED" not in out and "No such process" in out and alive


@both_users
def test_other_episodes_cannot_be_read_written_or_signalled(isolation, tmp_path):
    async def go():
        a = LocalSandbox(sandbox_cfg(tmp_path, isolation=isolation, wall_time_s=10))
        b = LocalSandbox(sandbox_cfg(tmp_path, isolation=isolation))
        try:
            await a.upload({"notes.txt": "episode A\n"})
            root = os.path.dirname(a.host_dir)
            work = asyncio.ensure_future(a.shell("sleep 2; cat notes.txt; echo done-A"))
            await asyncio.sleep(0.5)  # A's command is running
            attack = await b.shell(
                f"ls {root}; ls {a.host_dir}; echo x > {a.host_dir}/notes.txt; "
                f"touch {a.host_dir}/planted; rm -rf {a.host_dir}; kill -9 -1; echo END"
            )
            return await work, attack, a.host_dir
        finally:
            await a.close()
            await b.close()

    work, attack, a_dir = asyncio.run(go())
    assert work.ok and work.output == "episode A\ndone-A\n"  # untouched and not killed
    assert attack.output.rstrip().endswith("END") or attack.exit_code == 137
    assert "notes.txt" not in attack.output.replace(f"{a_dir}/notes.txt", "")


@both_users
def test_setuid_and_user_namespaces_grant_nothing(isolation, tmp_path):
    """No new privileges: setuid-root binaries run without their bits, no capabilities, and root
    inside a fresh user namespace still cannot write the host's files."""
    probe = (
        "grep -E '^(NoNewPrivs|CapEff|CapPrm):' /proc/self/status; "
        "mkdir -p m; mount -t tmpfs none m 2>&1 && echo MOUNTED; "
        "su -c 'id -u' root </dev/null 2>&1 && echo SU_OK; "
        "umount /usr 2>&1 && echo UMOUNTED; "
        "unshare -rm sh -c 'echo x > /etc/megathunder_userns' 2>&1; "
        "echo uid=$(id -u)"
    )

    async def go():
        sb = LocalSandbox(sandbox_cfg(tmp_path, isolation=isolation))
        try:
            return await sb.shell(probe), sb.contained_uid
        finally:
            await sb.close()

    result, uid = asyncio.run(go())
    out = result.output
    assert "NoNewPrivs:\t1" in out
    assert "CapEff:\t0000000000000000" in out and "CapPrm:\t0000000000000000" in out
    assert not any(w in out for w in ("MOUNTED", "SU_OK", "UMOUNTED"))
    assert not os.path.exists("/etc/megathunder_userns")
    assert out.rstrip().endswith(f"uid={uid}")
