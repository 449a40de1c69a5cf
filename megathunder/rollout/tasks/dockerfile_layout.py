"""What of a task's Dockerfile the local sandbox can provide: the files it copies into its work dir.

The local sandbox has no images. A task environment whose Dockerfile only picks a base image,
sets its ``WORKDIR`` and ``COPY`` / ``ADD``s files of its build context under that directory is
laid out exactly by uploading those files there (the host's system directories stand for the
base image's: the task's tools must be on the host, which a check's oracle run shows). Every other
instruction that changes what a command sees -- ``RUN``, ``ENV``, ``USER``, ``SHELL``, ``VOLUME``,
a copy from a URL, another stage or outside the work dir -- makes the environment one the local
sandbox cannot provide: :func:`local_layout` then returns the reason, naming the file and line,
and the sandbox refuses the task with it. ``CMD``, ``ENTRYPOINT``, ``LABEL``, ``EXPOSE``, ``ARG``,
``HEALTHCHECK``, ``STOPSIGNAL`` and ``MAINTAINER`` change nothing the harness uses (it runs its own
command in the container).
"""

from __future__ import annotations

import posixpath
import re
import shlex
from pathlib import Path

from megathunder.rollout.sandbox import LocalLayout

IGNORED = {"FROM", "CMD", "ENTRYPOINT", "LABEL", "EXPOSE", "ARG", "HEALTHCHECK", "STOPSIGNAL", "MAINTAINER"}
MAX_BYTES = 16 << 20  # all files together: more is an image's job, not an upload's


def instructions(text: str) -> list[tuple[int, str, str]]:
    """``(line, INSTRUCTION, arguments)`` of a Dockerfile: continuation lines joined, comments and
    parser directives dropped."""
    out: list[tuple[int, str, str]] = []
    buf, start = "", 0
    for num, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if not buf:
            start = num
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        word, _, args = buf.partition(" ")
        out.append((start, word.upper(), args.strip()))
        buf = ""
    return out


def local_layout(dockerfile: Path, context: Path) -> LocalLayout:
    """The files ``dockerfile`` puts in its work dir, or why the local sandbox cannot lay it out."""
    try:
        text = dockerfile.read_text()
    except (OSError, UnicodeDecodeError) as err:
        return LocalLayout(refusal=f"{dockerfile}: unreadable ({err})")
    workdir = "/"
    copied: dict[str, bytes] = {}  # absolute path -> content
    for num, word, args in instructions(text):
        where = f"{dockerfile}:{num}"
        if word in IGNORED:
            continue
        if word == "WORKDIR":
            workdir = posixpath.normpath(posixpath.join(workdir, args.strip("\"'")))
            continue
        if word not in ("COPY", "ADD"):
            return LocalLayout(refusal=f"{where}: {word} {args[:60]} (the local sandbox runs no build steps)")
        try:
            parts = shlex.split(args)
        except ValueError as err:
            return LocalLayout(refusal=f"{where}: {word}: {err}")
        flags = [p for p in parts if p.startswith("--")]
        paths = [p for p in parts if not p.startswith("--")]
        if any(f.startswith("--from") for f in flags) or len(paths) < 2:
            return LocalLayout(refusal=f"{where}: {word} {args[:60]} (not a copy of the build context)")
        *sources, dest = paths
        dest_abs = posixpath.normpath(posixpath.join(workdir, dest))
        into_dir = dest.endswith("/") or len(sources) > 1
        for src in sources:
            if re.match(r"^[a-z]+://", src):
                return LocalLayout(refusal=f"{where}: {word} from a URL ({src})")
            matches = sorted(context.glob(src)) if any(c in src for c in "*?[") else [context / src]
            for m in matches:
                if not m.exists() or not m.resolve().is_relative_to(context.resolve()):
                    return LocalLayout(refusal=f"{where}: {word} {src}: not in the build context {context}")
                found = [f for f in sorted(m.rglob("*")) if f.is_file()] if m.is_dir() else [m]
                for f in found:
                    rel = f.relative_to(m).as_posix() if m.is_dir() else f.name
                    target = posixpath.join(dest_abs, rel) if m.is_dir() or into_dir else dest_abs
                    copied[posixpath.normpath(target)] = f.read_bytes()
    if workdir == "/":
        return LocalLayout(refusal=f"{dockerfile}: no WORKDIR (the local sandbox needs the task's work directory)")
    files: dict[str, bytes] = {}
    for path, content in copied.items():
        if not path.startswith(workdir.rstrip("/") + "/"):
            return LocalLayout(refusal=f"{dockerfile}: copies {path}, outside its work directory {workdir}")
        files[path[len(workdir.rstrip("/")) + 1:]] = content
    if sum(len(c) for c in files.values()) > MAX_BYTES:
        return LocalLayout(refusal=f"{dockerfile}: copies over {MAX_BYTES >> 20} MiB into its work directory")
    return LocalLayout(workdir=workdir, files=files)
