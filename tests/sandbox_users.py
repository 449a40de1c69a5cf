"""Run a sandbox test as root and as an ordinary user (the rootless local sandbox).

The ordinary user is created once (``useradd``, when root). The test body runs in a forked copy
of this test process that has dropped to that user's uid and gid with no supplementary groups
(the system calls ``setpriv --reuid --regid --clear-groups`` makes): ``runuser`` cannot be used
here because the interpreter and its packages live below ``/root`` (mode 0700 on this machine),
which an ordinary user cannot read; a fork keeps the already imported modules. The child reports
its outcome (or its traceback) through a pipe; the parent waits with a bound.
"""

from __future__ import annotations

import functools
import inspect
import os
import pickle
import pwd
import select
import shutil
import subprocess
import tempfile
import time
import traceback
from pathlib import Path

import pytest

USER = "megathunder-sbx-test"
WHO = ["root", "user"]
_TIMEOUT_S = 300


def ordinary_user() -> tuple[int, int]:
    """(uid, gid) of the test user, created when missing; skips when that is impossible."""
    if os.geteuid() != 0:
        pytest.skip("creating the ordinary test user needs root (this run is rootless already)")
    try:
        entry = pwd.getpwnam(USER)
    except KeyError:
        if shutil.which("useradd") is None:
            pytest.skip("useradd not available to create an ordinary user")
        proc = subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", USER],
            capture_output=True, text=True,
        )  # fmt: skip
        if proc.returncode != 0 and "already exists" not in proc.stderr:
            pytest.skip(f"useradd {USER} failed: {proc.stderr.strip()}")
        entry = pwd.getpwnam(USER)
    if shutil.which("runuser") is None or shutil.which("unshare") is None:
        pytest.skip("runuser or unshare (util-linux) missing: cannot check user namespaces")
    check = subprocess.run(["runuser", "-u", USER, "--", "unshare", "--user", "true"],
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    if check.returncode != 0:
        pytest.skip(f"user namespaces are not allowed for an ordinary user here: {check.stderr.strip()}")
    return entry.pw_uid, entry.pw_gid


def run_as(uid: int, gid: int, fn, *args):
    """``fn(*args)`` in a forked child as ``uid``/``gid``; returns its value or re-raises its
    failure (an assertion's text included) in this process."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop privileges, run, report, exit without pytest's teardown
        os.close(r)
        try:
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
            os.environ["HOME"] = "/tmp"
            out = ("ok", fn(*args))
        except BaseException as err:  # noqa: BLE001 -- every failure goes back to the parent
            out = ("err", f"{type(err).__name__}: {err}\n{traceback.format_exc()}")
        try:
            data = pickle.dumps(out)
        except Exception as err:  # noqa: BLE001
            data = pickle.dumps(("err", f"unpicklable result: {err}"))
        with os.fdopen(w, "wb") as f:
            f.write(data)
        os._exit(0)
    os.close(w)
    chunks, deadline = [], time.monotonic() + _TIMEOUT_S
    with os.fdopen(r, "rb") as f:
        while (left := deadline - time.monotonic()) > 0 and select.select([f], [], [], left)[0]:
            if not (chunk := os.read(f.fileno(), 1 << 16)):
                break  # EOF: the child is done
            chunks.append(chunk)
        else:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            raise AssertionError(f"the child running as uid {uid} took over {_TIMEOUT_S} s")
    data = b"".join(chunks)
    os.waitpid(pid, 0)
    if not data:
        raise AssertionError(f"the child running as uid {uid} died without a report")
    kind, value = pickle.loads(data)
    if kind == "err":
        raise AssertionError(f"as uid {uid}: {value}")
    return value


def both_users(test):
    """Parametrize ``test(isolation, tmp_path)`` by ``who``: as root, and as the ordinary user
    (with a temporary directory of that user's own instead of root's private ``tmp_path``)."""

    @pytest.mark.parametrize("who", WHO)
    @functools.wraps(test)
    def wrapper(isolation, who, tmp_path):
        if who == "root" and os.geteuid() != 0:
            pytest.skip("not root: the rootful local sandbox needs root")
        if who == "root" or os.geteuid() != 0:  # as root; or rootless already: as this user
            return test(isolation, tmp_path)
        uid, gid = ordinary_user()
        own = tempfile.mkdtemp(prefix="megathunder-user-test-", dir="/tmp")
        os.chown(own, uid, gid)
        try:
            return run_as(uid, gid, test, isolation, Path(own))
        finally:
            shutil.rmtree(own, ignore_errors=True)

    wrapper.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD)
         for n in ("isolation", "who", "tmp_path")]
    )  # fmt: skip
    return wrapper
