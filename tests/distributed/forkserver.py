"""A fork server for the multi-process tests: imports torch, Megatron-core and transformers once,
then starts each launch's ranks by ``fork`` instead of ``torchrun`` + fresh interpreters.

Why: on a 2-core CI machine each rank's interpreter spends ~6-10 s importing the same modules, and
the distributed tier launches ~100 multi-rank jobs. A forked rank starts with those modules already
loaded; everything a test checks still runs in fresh processes (one fork per rank per launch, the
server itself never initialises torch.distributed, starts a thread or runs a worker).

Protocol (one JSON object per line on stdin, one reply per line on stdout)::

    {"worker": PATH, "argv": [...], "nproc": N, "port": P, "timeout": S, "log_dir": DIR}
    -> {"rc": 0 | first failing rank's code | 124 (timeout), "rank": failing rank or null}

Each rank gets torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT), runs ``PATH`` as ``__main__`` with ``argv``, and writes its output to
``DIR/rank<r>.out``. As under torchrun, the first rank to fail (or a timeout) ends the others;
each rank runs in its own process group, killed when the rank exits, so nothing it started outlives it.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import signal
import sys
import time
import traceback

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("PYTHONWARNINGS", "ignore")

import warnings  # noqa: E402

warnings.simplefilter("ignore")

# What every worker imports first; loading it here is the whole point.
import torch  # noqa: E402,F401
import torch.distributed  # noqa: E402,F401
import transformers  # noqa: E402,F401
import megatron.core  # noqa: E402,F401
import megatron.core.models.gpt  # noqa: E402,F401
import megatron.core.optimizer  # noqa: E402,F401
import megatron.core.distributed  # noqa: E402,F401
import megathunder.learner.learner  # noqa: E402,F401


def _child(worker: str, argv: list[str], rank: int, nproc: int, port: int, log_path: str) -> None:
    """In the forked rank: never returns."""
    code = 1
    try:
        os.setpgid(0, 0)
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        sys.stdin.close()
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                          LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port), TORCHELASTIC_RUN_ID="forkserver")
        sys.argv = [worker, *argv]
        # as `python tests/distributed/x_worker.py` from the repository root would see it, plus the
        # root itself (workers import tests.*; a clean clone is not on sys.path otherwise)
        sys.path[:0] = [os.path.dirname(worker), os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(worker))))]
        runpy.run_path(worker, run_name="__main__")
        code = 0
    except SystemExit as e:
        if isinstance(e.code, int) or e.code is None:
            code = e.code or 0
        else:  # sys.exit("message"): printed, exit 1, as the interpreter does
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        try:
            atexit._run_exitfuncs()  # as an interpreter's exit would: e.g. multiprocessing ends its children
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)


def _kill(*pids: int) -> None:
    """SIGKILL each rank's process group (the rank and everything it started)."""
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run(job: dict) -> dict:
    nproc, deadline = int(job["nproc"]), time.monotonic() + float(job["timeout"])
    live: dict[int, int] = {}  # pid -> rank, of the ranks still running
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            _child(job["worker"], list(job["argv"]), rank, nproc, int(job["port"]),
                   os.path.join(job["log_dir"], f"rank{rank}.out"))
        live[pid] = rank
    failed: tuple[int, int] | None = None  # (rank, code)
    while live:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if time.monotonic() > deadline:
                _kill(*live)
                for p in list(live):
                    os.waitpid(p, 0)
                return {"rc": 124, "rank": None}
            time.sleep(0.05)
            continue
        if pid not in live:
            continue
        rank = live.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        _kill(pid)  # whatever the rank left behind in its process group
        if code != 0 and failed is None:
            failed = (rank, code)
            _kill(*live)  # as torchrun: one failed rank ends the job
    return {"rc": 0, "rank": None} if failed is None else {"rc": failed[1] if failed[1] > 0 else 1, "rank": failed[0]}


def main() -> None:
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            reply = run(json.loads(line))
        except Exception as e:  # a bad request: say so, keep serving
            reply = {"rc": 1, "rank": None, "error": repr(e)}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
