"""The SWE harness environment: ``swebench`` 4.x and ``swesmith`` in a Python environment of their own.

Classic SWE-bench records (no ``eval_script``: SWE-bench Verified as first released and the sets
derived from it) get their eval script from the 4.x harness's ``make_test_spec``, and SWE-smith
records from the ``swesmith`` package's repository profiles (test command, log parser, image);
``swesmith`` is written against the 4.x harness. Neither installs beside the ``swebench`` 5.x this
package grades with, so they live in a virtual environment of their own
(:func:`setup_harness`, ``megathunder tasks setup-harness``: pinned versions from the package
index) and run there as a worker process (``swe_harness_worker.py``, under ``python -I``: neither its
directory, whose ``datasets.py`` would shadow the package of that name, nor ``PYTHONPATH`` on its
path) that answers JSON lines:

- :func:`convert_file` (``megathunder tasks convert-swe IN OUT``): every classic record to the 5.x
  form, in one worker;
- :class:`HarnessWorker`: a long-lived worker that grades SWE-smith test logs with the profile's
  own parser (``task.name=swe_smith``); the start-up (importing the profiles, ~6 s) is paid once.

The environment's Python: ``task.harness_python``, else ``$MEGATHUNDER_SWE_HARNESS_PYTHON``, else
``/opt/megathunder-swe-harness/bin/python``; missing, every use fails with the command that makes it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from megathunder.rollout.verifiers import InfrastructureError

SWEBENCH_4 = "swebench==4.1.0"
SWESMITH = "swesmith==0.0.9"
DEFAULT_DIR = "/opt/megathunder-swe-harness"
PYTHON_ENV = "MEGATHUNDER_SWE_HARNESS_PYTHON"
WORKER = Path(__file__).with_name("swe_harness_worker.py")
SWESMITH_PARSER = "swesmith"
"""``log_parser`` of a converted SWE-smith record: graded by its profile in the worker."""


class HarnessError(InfrastructureError):
    """The harness environment is missing or its worker failed (not a failing test)."""


def harness_python(explicit: str | None = None) -> str:
    """The harness environment's Python (see the module docstring), checked to exist."""
    path = explicit or os.environ.get(PYTHON_ENV) or f"{DEFAULT_DIR}/bin/python"
    if not os.access(path, os.X_OK):
        raise HarnessError(f"no SWE harness environment at {path} (swebench 4.x and swesmith, which cannot be "
                           f"installed beside swebench 5.x): make it with `megathunder tasks setup-harness` (or set "
                           f"{PYTHON_ENV} / task.harness_python)")
    return path


def setup_harness(directory: str = DEFAULT_DIR, python: str = sys.executable) -> str:
    """Create (or complete) the harness environment at ``directory`` from the package index; returns
    its Python. Idempotent: an environment with the pinned versions is left as it is."""
    py = f"{directory}/bin/python"
    want = {"swebench": SWEBENCH_4.split("==")[1], "swesmith": SWESMITH.split("==")[1]}
    if os.access(py, os.X_OK):
        try:
            if run_worker([{"op": "versions"}], py)[0] == want:
                return py
        except HarnessError:
            pass
    for cmd in ([python, "-m", "venv", directory], [py, "-m", "pip", "install", "-q", SWEBENCH_4, SWESMITH]):
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            raise HarnessError(f"{' '.join(cmd)} failed (exit {done.returncode}): {(done.stdout + done.stderr)[-1500:]}")
    got = run_worker([{"op": "versions"}], py)[0]
    if got != want:
        raise HarnessError(f"the harness environment at {directory} has {got}, not {want}")
    return py


def run_worker(requests: list[dict], python: str | None = None, timeout_s: float = 1800.0) -> list[Any]:
    """Answers to ``requests`` from one worker process, in order; a request the harness refused is
    answered by a :class:`HarnessError` (returned, not raised: the caller names the record)."""
    py = harness_python(python)
    body = "".join(json.dumps(r) + "\n" for r in requests)
    try:
        proc = subprocess.run([py, "-I", str(WORKER)], input=body, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise HarnessError(f"the SWE harness worker took over {timeout_s:g} s") from None
    lines = proc.stdout.splitlines()
    if proc.returncode != 0 or len(lines) != len(requests):
        raise HarnessError(f"the SWE harness worker ({py}) failed (exit {proc.returncode}): {proc.stderr[-1500:]}")
    answers = [json.loads(line) for line in lines]
    return [a["result"] if a["ok"] else HarnessError(a["error"]) for a in answers]


def convert_records(records: list[tuple[str, dict]], python: str | None = None,
                    namespace: str = "swebench") -> list[dict]:
    """The 5.x form of every record (``(where, record)`` pairs, as ``datasets.read_records`` gives
    them); a record the harness cannot convert raises naming it."""
    answers = run_worker([{"op": "convert", "record": r, "namespace": namespace} for _, r in records], python)
    out = []
    for (where, _), answer in zip(records, answers, strict=True):
        if isinstance(answer, HarnessError):
            raise HarnessError(f"{where}: {answer}")
        out.append(answer)
    return out


class HarnessWorker:
    """One long-lived worker (started on first use, again if it dies), answering one request at a
    time; thread-safe, so async callers use it through ``asyncio.to_thread``."""

    def __init__(self, python: str | None = None, timeout_s: float = 300.0) -> None:
        self.python, self.timeout_s = python, timeout_s
        self._proc: subprocess.Popen[str] | None = None
        self._lock = threading.Lock()

    def call(self, request: dict) -> Any:
        with self._lock:
            for attempt in (0, 1):
                proc = self._start()
                assert proc.stdin is not None and proc.stdout is not None
                try:
                    proc.stdin.write(json.dumps(request) + "\n")
                    proc.stdin.flush()
                    line = _readline(proc, self.timeout_s)
                except (OSError, TimeoutError) as err:
                    self._stop()
                    if attempt:
                        raise HarnessError(f"the SWE harness worker failed: {err}") from None
                    continue
                answer = json.loads(line)
                if not answer["ok"]:
                    raise HarnessError(f"the SWE harness refused {request.get('op')}: {answer['error']}")
                return answer["result"]
        raise AssertionError("unreachable")

    def _start(self) -> subprocess.Popen[str]:
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen([harness_python(self.python), "-I", str(WORKER)], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        return self._proc

    def _stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def close(self) -> None:
        with self._lock:
            self._stop()

    def __del__(self) -> None:
        proc = getattr(self, "_proc", None)
        if proc is not None and proc.poll() is None:
            proc.kill()


def _readline(proc: subprocess.Popen[str], timeout_s: float) -> str:
    """One answer line, or TimeoutError / OSError (the worker hung or died)."""
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(proc.stdout.readline() if proc.stdout else ""), daemon=True)
    reader.start()
    reader.join(timeout_s)
    if reader.is_alive():
        raise TimeoutError(f"no answer in {timeout_s:g} s")
    if not got or not got[0]:
        raise OSError(f"the worker exited ({proc.poll()})")
    return got[0]
