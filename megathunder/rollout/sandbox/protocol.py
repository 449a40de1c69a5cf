"""The sandbox servers' HTTP protocol: paths, and the JSON forms of what crosses it.

    GET    /health                       open (no secret): {"status", "server_id", "backend",
                                         "max_sandboxes", "open"}; 503 while shutting down
    GET    /metrics[?format=json]        Prometheus text (or JSON): sandboxes per state, episodes,
                                         rejections, per-operation latencies
    POST   /sandboxes                    {"image", "environment", "limits", "owner"} -> 201
                                         {"id", "workdir", "tmp_dir"}; 429 at the server's bound
    POST   /sandboxes/{id}/exec          {"request_id", "argv", "stdin_b64", "timeout_s",
                                         "max_output_bytes", "limits"} -> an ExecResult
    POST   /sandboxes/{id}/cancel        {"request_id"}: kill a command whose client gave up on it
    PUT    /sandboxes/{id}/files         a tar archive, extracted in the work dir
    GET    /sandboxes/{id}/files?path=P  a tar archive of P
    DELETE /sandboxes/{id}               destroy it (again: 200)

Every path but ``/health`` needs ``Authorization: Bearer <secret>`` when the server has one. Errors
are ``{"error": "<message>", "kind": "<kind>"}`` with ``kind`` one of :data:`ERROR_KINDS`. An
``exec`` is idempotent by its ``request_id``: a request sent again (the connection dropped) gets the
first one's result, never a second run. Bytes (stdin, a task's laid-out files) travel as base64.
"""

from __future__ import annotations

import base64
from dataclasses import asdict, fields
from typing import Any, Literal

from megathunder.rollout.sandbox.core import CommandLimits, Environment, ExecResult, ImageBuild, LocalLayout

ErrorKind = Literal["unauthorized", "bad_request", "unknown_sandbox", "destroyed", "over_bound",
                    "sandbox_error", "cancelled", "shutting_down"]
ERROR_KINDS: tuple[str, ...] = ("unauthorized", "bad_request", "unknown_sandbox", "destroyed", "over_bound",
                                "sandbox_error", "cancelled", "shutting_down")
STATUS: dict[str, int] = {"unauthorized": 401, "bad_request": 400, "unknown_sandbox": 404, "destroyed": 410,
                          "over_bound": 429, "sandbox_error": 500, "cancelled": 409, "shutting_down": 503}

LIMIT_FIELDS = ("wall_time_s", "cpu_time_s", "memory_mb", "max_processes", "max_file_size_mb",
                "max_output_bytes", "tmpfs_mb", "cpus")
"""The sandbox limits a create asks for (each sandbox's own): the runtime's fields of these names."""
CEILED_FIELDS = ("memory_mb", "max_processes", "max_file_size_mb", "max_output_bytes", "tmpfs_mb", "cpus")
"""Those a server caps at its own (what its node must hold); time limits are per command and free."""


def error(kind: ErrorKind, message: str) -> dict[str, str]:
    return {"error": message, "kind": kind}


def result_to_json(r: ExecResult) -> dict[str, Any]:
    return asdict(r)


def result_from_json(d: dict[str, Any]) -> ExecResult:
    names = {f.name for f in fields(ExecResult)}
    return ExecResult(**{k: v for k, v in d.items() if k in names})


def limits_to_json(limits: CommandLimits | None) -> dict[str, Any] | None:
    return None if limits is None else asdict(limits)


def limits_from_json(d: dict[str, Any] | None) -> CommandLimits | None:
    return None if d is None else CommandLimits(**d)


def bytes_to_json(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode()


def bytes_from_json(text: str | None) -> bytes | None:
    return None if text is None else base64.b64decode(text, validate=True)


def environment_to_json(env: Environment | None) -> dict[str, Any] | None:
    """An instance's environment. Paths of an image build are sent as they are: the server reads them
    from a file system it shares with the controller (a cluster's), or the image exists there."""
    if env is None:
        return None
    local = None
    if env.local is not None:
        local = {"workdir": env.local.workdir, "refusal": env.local.refusal,
                 "files": {k: bytes_to_json(v) for k, v in env.local.files.items()}}
    return {"name": env.name, "workdir": env.workdir, "network": env.network, "cpus": env.cpus,
            "memory_mb": env.memory_mb, "scratch_dirs": list(env.scratch_dirs),
            "build": None if env.build is None else asdict(env.build), "local": local}


def environment_from_json(d: dict[str, Any] | None) -> Environment | None:
    if d is None:
        return None
    local = d.get("local")
    layout = None
    if local is not None:
        layout = LocalLayout(workdir=local["workdir"], refusal=local["refusal"],
                             files={k: bytes_from_json(v) or b"" for k, v in local["files"].items()})
    build = d.get("build")
    return Environment(name=d["name"], workdir=d["workdir"], network=bool(d["network"]), cpus=d["cpus"],
                       memory_mb=d["memory_mb"], scratch_dirs=tuple(d["scratch_dirs"]),
                       build=None if build is None else ImageBuild(**build), local=layout)


__all__ = [
    "CEILED_FIELDS",
    "ERROR_KINDS",
    "LIMIT_FIELDS",
    "STATUS",
    "ErrorKind",
    "bytes_from_json",
    "bytes_to_json",
    "environment_from_json",
    "environment_to_json",
    "error",
    "limits_from_json",
    "limits_to_json",
    "result_from_json",
    "result_to_json",
]
