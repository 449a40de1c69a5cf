"""Container images without a registry: a Debian base image made by debootstrap, task images
built ``FROM`` it, and a probe for the podman options this machine needs.

No image registry is reachable from CI machines, but Debian's package mirror is (``apt-get``
works). So the base image is a Debian root file system made by ``debootstrap --variant=minbase``
with ``python3`` and ``git`` (the SWE-style tasks run ``python3 -m unittest`` and diff their
repositories), trimmed of apt's package cache, documentation and locales, streamed as a tar
archive into ``podman import``. Its tag carries a content key (a hash of the suite, mirror,
package list and this recipe's version), so a second build with the same inputs is a no-op: CI
builds it once per machine, the tests once per session (``megathunder sandbox build-base``).
A task image is ``FROM`` the base with a build context of the task's files (``build_image``);
``podman build`` reads the base from local storage and pulls nothing.

``probe_runtime`` runs one throwaway container and returns the global options needed to do so
here: none where podman's default OCI runtime works, ``--runtime runc`` where crun refuses
(cgroup v1/v2 hybrid hosts, e.g. a VM whose cgroup2 mount holds a controller); it raises with
every attempt's error where no container can run at all.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass

from megathunder.rollout.sandbox.container import LABEL
from megathunder.rollout.sandbox.core import SandboxError

RECIPE_VERSION = 4
"""Bumped when the recipe below changes in a way the key's inputs do not show."""
DEFAULT_SUITE = "bookworm"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
DEFAULT_PACKAGES = ("python3", "git", "ca-certificates")
BASE_REPOSITORY = "localhost/megathunder-base"
_TRIM = ("var/cache/apt/archives", "var/lib/apt/lists", "usr/share/doc", "usr/share/man",
         "usr/share/locale", "usr/share/info")  # fmt: skip
# The ulimits every probe or build container gets (podman's defaults exceed the hard limits of a
# host without CAP_SYS_RESOURCE); the sandbox sets its own from its config.
_ULIMITS = ("--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024")
_RUNTIME_CHOICES: tuple[tuple[str, ...], ...] = ((), ("--runtime", "runc"))


@dataclass(frozen=True)
class BaseImage:
    tag: str
    built: bool  # False: it existed already (same content key)
    seconds: float  # of the build (0 when it existed)


def base_image_key(
    suite: str = DEFAULT_SUITE,
    mirror: str = DEFAULT_MIRROR,
    packages: Sequence[str] = DEFAULT_PACKAGES,
) -> str:
    text = f"{RECIPE_VERSION}\n{suite}\n{mirror}\n{','.join(sorted(packages))}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _podman(cli: str, runtime_args: Sequence[str]) -> list[str]:
    return [cli, *runtime_args]


def image_exists(tag: str, cli: str = "podman", runtime_args: Sequence[str] = ()) -> bool:
    cmd = [*_podman(cli, runtime_args), "image", "inspect", tag]  # docker has no `image exists`
    return subprocess.run(cmd, capture_output=True, timeout=120).returncode == 0


def probe_runtime(cli: str = "podman", image: str | None = None) -> list[str]:
    """The global options with which ``cli`` runs a container of ``image`` with no network and a
    memory and pids limit; raises SandboxError with each attempt's error when none does."""
    if shutil.which(cli) is None:
        raise SandboxError(f"{cli!r} is not on PATH (apt-get install -y podman)")
    if image is None:
        raise SandboxError("probe_runtime needs an image (build the base image first)")
    errors = []
    for args in _RUNTIME_CHOICES:
        cmd = [
            cli, *args, "run", "--rm", "--network", "none", "--memory", "64m",
            "--pids-limit", "16", *_ULIMITS, image, "true",
        ]  # fmt: skip
        if args and shutil.which(args[1]) is None:
            errors.append(f"{' '.join(args)}: {args[1]!r} is not on PATH")
            continue
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if proc.returncode == 0:
            return list(args)
        errors.append(f"{' '.join(cmd)}: {proc.stderr.strip() or proc.returncode}")
    raise SandboxError("no container can run here:\n  " + "\n  ".join(errors))


def build_base_image(
    cli: str = "podman",
    runtime_args: Sequence[str] = (),
    suite: str = DEFAULT_SUITE,
    mirror: str = DEFAULT_MIRROR,
    packages: Sequence[str] = DEFAULT_PACKAGES,
    work_dir: str | None = None,
) -> BaseImage:
    """Build (or find, by content key) the Debian base image; needs root and ``debootstrap``."""
    tag = f"{BASE_REPOSITORY}:{base_image_key(suite, mirror, packages)}"
    if image_exists(tag, cli, runtime_args):
        return BaseImage(tag, built=False, seconds=0.0)
    if shutil.which("debootstrap") is None:
        raise SandboxError("building the base image needs debootstrap (apt-get install -y debootstrap)")
    if os.geteuid() != 0:
        raise SandboxError("building the base image with debootstrap needs root")
    start = time.monotonic()
    root = tempfile.mkdtemp(prefix="megathunder-rootfs-", dir=work_dir)
    try:
        cmd = ["debootstrap", "--variant=minbase", f"--include={','.join(packages)}", suite, root, mirror]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            tail = (proc.stdout + proc.stderr)[-2000:]
            raise SandboxError(f"debootstrap failed ({' '.join(cmd)}):\n{tail}")
        for rel in _TRIM:
            path = os.path.join(root, rel)
            if os.path.isdir(path):
                shutil.rmtree(path)
                os.mkdir(path)
        os.makedirs(os.path.join(root, "workspace"), mode=0o755, exist_ok=True)  # the work dir
        # podman import makes the image's / mode 0555, where root without capabilities (the sandbox
        # runs --cap-drop ALL) cannot create a directory: the ones benchmarks' graders write exist
        for rel in ("tests", "logs", "logs/verifier", "logs/agent"):
            os.makedirs(os.path.join(root, rel), mode=0o755, exist_ok=True)
        tar = subprocess.Popen(["tar", "-C", root, "-c", "."], stdout=subprocess.PIPE)
        imp = subprocess.run(
            [*_podman(cli, runtime_args), "import", "--change", "WORKDIR /workspace", "-", tag],
            stdin=tar.stdout, capture_output=True, text=True, timeout=1800,
        )  # fmt: skip
        assert tar.stdout is not None
        tar.stdout.close()
        if tar.wait() != 0 or imp.returncode != 0:
            raise SandboxError(f"podman import of {root} failed: {imp.stderr.strip()}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return BaseImage(tag, built=True, seconds=time.monotonic() - start)


def build_image(
    tag: str,
    containerfile: str,
    context: dict[str, str | bytes],
    cli: str = "podman",
    runtime_args: Sequence[str] = (),
) -> str:
    """Build ``tag`` from ``containerfile`` text (``FROM`` a local image) with ``context`` (relative
    path -> content) as its build context; returns ``tag``. Nothing is pulled."""
    with tempfile.TemporaryDirectory(prefix="megathunder-build-") as ctx:
        for rel, content in context.items():
            path = os.path.join(ctx, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(content.encode() if isinstance(content, str) else content)
        with open(os.path.join(ctx, "Containerfile"), "w") as f:
            f.write(containerfile)
        cmd = [
            *_podman(cli, runtime_args), "build", "--pull=never", "--network", "none", *_ULIMITS,
            "-t", tag, "-f", os.path.join(ctx, "Containerfile"), ctx,
        ]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            raise SandboxError(f"podman build of {tag} failed:\n{(proc.stdout + proc.stderr)[-2000:]}")
    return tag


def build_from_directory(tag: str, dockerfile: str, context: str, cli: str = "podman",
                         runtime_args: Sequence[str] = (), timeout_s: float = 1800.0, network: bool = False) -> str:
    """``podman build -f dockerfile context`` tagged ``tag`` (a task directory's environment). Its
    ``FROM`` is pulled only when missing (offline: it must name a local image, e.g. the base
    image); its ``RUN`` steps get the runtime's default network when ``network`` (the task's
    harness builds with one), else none. A build that fails or outlives ``timeout_s`` (Harbor's
    ``build_timeout_sec``) raises :class:`SandboxError`."""
    net = [] if network else ["--network", "none"]
    cmd = [*_podman(cli, runtime_args), "build", "--pull=missing", *net, *_ULIMITS,
           "-t", tag, "-f", dockerfile, context]  # fmt: skip
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise SandboxError(f"{cli} build of {tag} from {dockerfile} took over {timeout_s:g} s") from None
    if proc.returncode != 0:
        raise SandboxError(f"{cli} build of {tag} from {dockerfile} failed:\n{(proc.stdout + proc.stderr)[-2000:]}")
    return tag


def leftover_containers(cli: str = "podman", runtime_args: Sequence[str] = ()) -> list[str]:
    """Names of containers (running or not) that a sandbox started (they carry its label)."""
    cmd = [*_podman(cli, runtime_args), "ps", "--all", "--filter", f"label={LABEL}",
           "--format", "{{.Names}}"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise SandboxError(f"{' '.join(cmd)} failed: {proc.stderr.strip()}")
    return proc.stdout.split()


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``megathunder sandbox build-base`` and ``probe`` (the action is the subcommand)."""
    p.add_argument("--cli", default="podman", help="the container CLI (default podman)")
    p.add_argument("--suite", default=DEFAULT_SUITE, help=f"Debian suite (default {DEFAULT_SUITE})")
    p.add_argument("--mirror", default=DEFAULT_MIRROR, help=f"Debian mirror (default {DEFAULT_MIRROR})")
    p.add_argument("--packages", default=",".join(DEFAULT_PACKAGES),
                   help=f"packages besides minbase (default {','.join(DEFAULT_PACKAGES)})")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """Prints one JSON object: the base image's tag, whether it was built now and in how many
    seconds, and ``runtime_args`` (for ``sandbox.runtime_args``)."""
    packages = [p for p in args.packages.split(",") if p]
    tag = f"{BASE_REPOSITORY}:{base_image_key(args.suite, args.mirror, packages)}"
    # import needs no OCI runtime, so the base can be built before the probe picks one
    base = BaseImage(tag, built=False, seconds=0.0)
    try:
        if shutil.which(args.cli) is None:
            raise SandboxError(f"{args.cli!r} is not on PATH (apt-get install -y podman)")
        if args.action == "build-base":
            base = build_base_image(args.cli, (), args.suite, args.mirror, packages)
        elif not image_exists(tag, args.cli):
            raise SandboxError(f"no base image {tag}: run `megathunder sandbox build-base` first")
        runtime_args = probe_runtime(args.cli, base.tag)
    except SandboxError as err:
        print(f"megathunder sandbox {args.action}: {err}", file=sys.stderr)
        return 2
    print(json.dumps({"image": base.tag, "built": base.built, "seconds": round(base.seconds, 1),
                      "runtime_args": runtime_args}))  # fmt: skip
    return 0


__all__ = [
    "BaseImage",
    "base_image_key",
    "build_base_image",
    "build_image",
    "image_exists",
    "leftover_containers",
    "probe_runtime",
]
