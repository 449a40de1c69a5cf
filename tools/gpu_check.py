"""Every GPU check in one call, for one GPU, in at most eight minutes (``tools/gpu_check.sh``).

The plan is ``STEPS``: one pytest run of the single-GPU tests, then two benchmarks, each with a
time budget; the budgets sum to at most ``BUDGET_S`` and a step never runs past what is left of it.
What comes back is one JSON summary, ``$OUT/gpu_check.json``: the machine, each step's outcome
(pytest's passed / failed / skipped with every skip's reason, a benchmark's own JSON line) and the
figures the tests record (``tests/gpu_helpers.record``), plus the whole log beside it.

The lent GPU machine has Python 3.12 and a CUDA torch but no megatron-core, Transformer Engine or
vLLM, and no network: the wheels in ``tools/gpu_check_wheels.txt`` are carried (``gpu_check.sh``
installs them); Transformer Engine's tests and layouts skip themselves without it, and so do the
tests that need two GPUs, each with its reason.

``--dry-run`` (CI, on CPU, in seconds) checks the plan without running it: the budgets, the wheel
list (pinned, and the versions this machine tests with), every test file's ``megathunder`` and
``tests`` imports -- function-level ones included, which a GPU-less run never executes -- resolved
against the source (a stale import fails it), every test function marked ``gpu`` (``-m gpu`` would
drop it silently otherwise), and the benchmarks' arguments parsed by their own parsers.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUDGET_S = 480
"""Eight minutes on one H100, every step included."""
WHEELS = REPO / "tools" / "gpu_check_wheels.txt"
FIGURES_ENV = "MEGATHUNDER_GPU_FIGURES"  # tests/gpu_helpers.py's


@dataclass(frozen=True)
class Step:
    name: str
    budget_s: int
    tests: tuple[str, ...] = ()  # a pytest step: these files, ``-m gpu``
    bench: tuple[str, ...] = ()  # a benchmark step: ``megathunder bench`` + these arguments


STEPS = (
    Step("gpu_tests", 200, tests=(
        "tests/gpu/test_routing_capture_gpu.py",  # the recorder's capture inside a CUDA graph
        "tests/gpu/test_wire_gpu.py",  # weight frames of CUDA tensors over gloo
        "tests/gpu/test_logprobs_gpu.py",  # learner bf16 logprobs vs transformers
        "tests/gpu/test_ledger_slots_gpu.py",  # host-placed ledger slots vs device slots
        "tests/gpu/test_learner_gpu.py",  # streamed == sync in bf16 (dense, MoE; TE and FP8 with TE)
        "tests/gpu/test_long_context_gpu.py",  # CP and TP+SP on TE: two GPUs (skips here, with its reason)
    )),
    # megathunder plan vs CUDA's max allocated memory (tests/gpu/test_memory_plan_gpu.py runs every layout)
    Step("plan_vs_peak", 170, bench=("memory", "--device", "cuda", "--timeout", "80", "--layouts",
                                     "G bf16 K2 fp32 s2048", "G bf16 K4 host-slots s2048")),
    Step("learner_throughput", 100, bench=("learner", "--dtype", "bfloat16", "--layer-spec", "local",
                                           "--hidden-size", "2048", "--num-layers", "8", "--num-heads", "16",
                                           "--vocab-size", "32768", "--seq-len", "2048", "--num-groups", "4",
                                           "--group-size", "4", "--repeats", "3")),
)

NOT_RUN = {
    "tests/gpu/test_weight_transfer_gpu.py": "NCCL between two GPUs (one rank per GPU) -- on one GPU the "
                                             "frames go over gloo (test_wire_gpu.py)",
    "tests/gpu/test_memory_plan_gpu.py": "every layout of bench memory --device cuda (about 15 minutes): the "
                                         "plan_vs_peak step runs two of them",
    "tests/gpu/test_opd_gpu.py": "per-turn OPD on CUDA: outside the eight minutes (run it alone)",
}


# ---------------------------------------------------------------------------- the run


@dataclass
class Outcome:
    name: str
    seconds: float = 0.0
    returncode: int | None = None
    timed_out: bool = False
    result: dict = field(default_factory=dict)


def _run(argv: list[str], budget: float, log) -> tuple[int | None, bool, str]:
    log.write(f"$ {' '.join(argv)}  (budget {budget:.0f} s)\n")
    log.flush()
    try:
        proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=max(budget, 1.0))
    except subprocess.TimeoutExpired as err:
        out = (err.stdout or b"").decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
        log.write(out + f"\n[timed out after {budget:.0f} s]\n")
        return None, True, out
    log.write(proc.stdout + proc.stderr + "\n")
    return proc.returncode, False, proc.stdout


def junit_counts(path: Path) -> dict:
    """pytest's counts and every skip's reason from its JUnit XML."""
    if not path.exists():
        return {"error": "pytest wrote no report"}
    root = ET.parse(path).getroot()
    out: dict = {"passed": 0, "failed": 0, "skipped": 0, "skips": {}, "failures": {}}
    for case in root.iter("testcase"):
        test = f"{case.get('file') or case.get('classname')}::{case.get('name')}"
        skipped = case.find("skipped")
        failed = case.find("failure") if case.find("failure") is not None else case.find("error")
        if skipped is not None:
            out["skipped"] += 1
            out["skips"][test] = skipped.get("message", "")
        elif failed is not None:
            out["failed"] += 1
            out["failures"][test] = (failed.get("message") or "")[:500]
        else:
            out["passed"] += 1
    return out


def last_json_line(text: str) -> dict:
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                break
    return {}


def run(out_dir: Path) -> int:
    import torch

    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    figures = work / "figures.jsonl"
    os.environ[FIGURES_ENV] = str(figures)
    summary: dict = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "num_gpus": torch.cuda.device_count(),
        "torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0],
        "packages": {name: _version(name) for name in ("megatron-core", "transformer_engine", "vllm", "transformers")},
        "budget_s": BUDGET_S, "not_run": NOT_RUN, "steps": [],
    }
    ok = True
    with open(out_dir / "gpu_check.log", "w") as log:
        for step in STEPS:
            left = BUDGET_S - (time.monotonic() - start)
            outcome = Outcome(step.name)
            t0 = time.monotonic()
            if step.tests:
                report = work / f"{step.name}.xml"
                argv = [sys.executable, "-m", "pytest", *step.tests, "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider",
                        f"--junitxml={report}"]
                outcome.returncode, outcome.timed_out, _ = _run(argv, min(step.budget_s, left), log)
                outcome.result = junit_counts(report)
                ok &= outcome.returncode == 0
            else:
                argv = [sys.executable, "-m", "megathunder.cli", "bench", *step.bench]
                outcome.returncode, outcome.timed_out, stdout = _run(argv, min(step.budget_s, left), log)
                outcome.result = last_json_line(stdout)
                ok &= outcome.returncode == 0 and bool(outcome.result)
            outcome.seconds = round(time.monotonic() - t0, 1)
            summary["steps"].append(outcome.__dict__)
    summary["figures"] = [json.loads(line) for line in figures.read_text().splitlines()] if figures.exists() else []
    summary["total_s"] = round(time.monotonic() - start, 1)
    summary["ok"] = bool(ok)
    (out_dir / "gpu_check.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: summary[k] for k in ("device", "total_s", "ok")}))
    return 0 if ok else 1


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


# ---------------------------------------------------------------------------- the dry run


def module_file(module: str) -> Path | None:
    """The source file of a module of this repository (``megathunder.*``, ``tests.*``), or None."""
    base = REPO.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _bound_names(body: list[ast.stmt]) -> set[str]:
    """Names a module binds at its top level (inside top-level if / try blocks too)."""
    names: set[str] = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, ast.Import):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.update(a.asname or a.name for a in node.names)
        elif isinstance(node, (ast.If, ast.Try)):
            for block in (node.body, node.orelse, getattr(node, "finalbody", []),
                          *[h.body for h in getattr(node, "handlers", [])]):
                names |= _bound_names(block)
    return names


def module_names(module: str, seen: frozenset[str] = frozenset()) -> set[str] | None:
    """What ``from module import X`` can take: its top-level names, star imports followed, and its
    submodules. None: no such module in the repository."""
    path = module_file(module)
    if path is None:
        return None
    tree = ast.parse(path.read_text(), str(path))
    names = _bound_names(tree.body)
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names) and node.module \
                and node.module not in seen:
            names |= module_names(node.module, seen | {module}) or set()
    if path.name == "__init__.py":
        names |= {p.stem for p in path.parent.glob("*.py")} | {p.name for p in path.parent.iterdir() if p.is_dir()}
    return names


def stale_imports(test_file: Path) -> tuple[list[str], list[str]]:
    """(every repository name the file imports, at any depth, that does not resolve; the optional
    modules it asks for with ``pytest.importorskip``)."""
    tree = ast.parse(test_file.read_text(), str(test_file))
    missing, optional = [], []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in ("megathunder", "tests") and module_file(alias.name) is None:
                    missing.append(f"import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.split(".")[0] in ("megathunder", "tests"):
            names = module_names(node.module)
            if names is None:
                missing.append(f"from {node.module} (no such module)")
                continue
            missing += [f"from {node.module} import {a.name}" for a in node.names if a.name not in names]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "importorskip" and node.args \
                and isinstance(node.args[0], ast.Constant):
            optional.append(str(node.args[0].value))
    return missing, optional


def unmarked_tests(test_file: Path) -> list[str]:
    """Test functions without ``@pytest.mark.gpu`` (``-m gpu`` would deselect them)."""
    tree = ast.parse(test_file.read_text(), str(test_file))
    out = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
            marks = {ast.unparse(d) for d in node.decorator_list}
            if not any(m.startswith("pytest.mark.gpu") for m in marks):
                out.append(node.name)
    return out


def wheel_problems(path: Path = WHEELS) -> list[str]:
    """The carried wheels: one ``name==version`` a line, no name twice, megatron-core among them,
    each the version installed on this machine (the one CI tests with)."""
    problems, seen = [], set()
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9_.\-]+)==([A-Za-z0-9_.+\-]+)", line)
        if m is None:
            problems.append(f"{path.name}: {line!r} is not name==version")
            continue
        name, version = m.group(1).lower().replace("_", "-"), m.group(2)
        if name in seen:
            problems.append(f"{path.name}: {name} twice")
        seen.add(name)
        installed = _version(name)
        if installed != version:
            problems.append(f"{path.name}: {name}=={version}, but this machine tests {name} {installed}")
    if "megatron-core" not in seen:
        problems.append(f"{path.name}: megatron-core is not carried")
    return problems


def bench_problems(step: Step) -> list[str]:
    """The benchmark's own parser accepts the step's arguments (and memory's layouts exist)."""
    kind, *argv = step.bench
    if kind == "learner":
        from megathunder.bench import learner_step

        try:
            learner_step._args(argv)
        except SystemExit:
            return [f"{step.name}: megathunder bench learner rejects {argv}"]
        return []
    if kind == "memory":
        from megathunder.bench import memory_fit

        layouts = argv[argv.index("--layouts") + 1:] if "--layouts" in argv else []
        unknown = [n for n in layouts if n not in memory_fit.GPU_LAYOUTS]
        return [f"{step.name}: unknown GPU layouts {unknown}"] if unknown else []
    return [f"{step.name}: no check for megathunder bench {kind}"]


def dry_run() -> int:
    problems = []
    total = sum(s.budget_s for s in STEPS)
    if total > BUDGET_S:
        problems.append(f"the steps' budgets sum to {total} s, over {BUDGET_S} s")
    problems += wheel_problems()
    listed = set(NOT_RUN)
    for step in STEPS:
        for name in step.tests:
            listed.add(name)
            path = REPO / name
            if not path.is_file():
                problems.append(f"{name}: no such test file")
                continue
            missing, optional = stale_imports(path)
            problems += [f"{name}: {m}" for m in missing]
            problems += [f"{name}: {t} has no @pytest.mark.gpu" for t in unmarked_tests(path)]
            optional = sorted(set(optional))
            print(f"{name}: imports resolve" + (f"; optional: {', '.join(optional)}" if optional else ""))
        if step.bench:
            problems += bench_problems(step)
    unlisted = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests" / "gpu").glob("test_*.py"))
    problems += [f"{name}: neither run nor listed in NOT_RUN" for name in unlisted if name not in listed]
    for name in sorted(NOT_RUN):  # not run in the eight minutes, but their imports must not go stale either
        missing, _ = stale_imports(REPO / name)
        problems += [f"{name}: {m}" for m in missing]
    for problem in problems:
        print(f"gpu_check --dry-run: {problem}", file=sys.stderr)
    print(f"gpu_check --dry-run: {len(STEPS)} steps, {total} s of {BUDGET_S} s; "
          f"{'ok' if not problems else f'{len(problems)} problems'}")
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="check the plan on any machine, run nothing")
    p.add_argument("--out", default=os.environ.get("OUT", "gpu_check_out"))
    args = p.parse_args(argv)
    if str(REPO) not in sys.path:  # run as a script: the repository's packages, not an installed copy
        sys.path.insert(0, str(REPO))
    return dry_run() if args.dry_run else run(Path(args.out))


if __name__ == "__main__":
    sys.exit(main())
