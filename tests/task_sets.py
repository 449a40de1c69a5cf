"""Terminal-Bench 1 and Harbor task directories written for the tests (none is a benchmark's task).

``checked_set`` writes a set for ``megathunder tasks check``: good tasks of both formats, and the
planted bad ones -- a false positive (its test passes whatever the agent does) and a broken oracle
(its solution does not solve it). ``base`` is the image their Dockerfiles start ``FROM`` (the local
sandbox only reads their WORKDIR and COPY lines).
"""

from __future__ import annotations

from pathlib import Path

PYTEST_SUMMARY = """\
#!/bin/bash
# a stand-in for `uv run pytest $TEST_DIR/test_outputs.py -rA`: pytest's -rA summary, written by bash
echo '=========================== short test summary info ============================'
if {check}; then echo 'PASSED ../tests/test_outputs.py::test_goal'
else echo 'FAILED ../tests/test_outputs.py::test_goal - AssertionError'; fi
"""
HARBOR_TEST = '#!/bin/bash\nif {check}; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi\n'


def tb1_task(root: Path, name: str, base: str, *, check: str, solution: str, yaml_extra: str = "",
             dockerfile_extra: str = "") -> Path:
    d = root / name
    (d / "tests").mkdir(parents=True)
    (d / "task.yaml").write_text(f"instruction: |\n  Task {name}: see input.txt.\n{yaml_extra}")
    (d / "Dockerfile").write_text(f"FROM {base}\nWORKDIR /app\nCOPY input.txt /app/\n{dockerfile_extra}")
    (d / "input.txt").write_text("abc\n")
    (d / "run-tests.sh").write_text(PYTEST_SUMMARY.format(check=check))
    (d / "tests" / "expected.txt").write_text("ABC\n")
    (d / "solution.sh").write_text(solution)
    return d


def harbor_task(root: Path, name: str, base: str, *, check: str, solution: str, toml_extra: str = "",
                dockerfile_extra: str = "", allow_internet: bool = False, test_files: dict | None = None) -> Path:
    d = root / name
    for sub in ("environment", "tests", "solution"):
        (d / sub).mkdir(parents=True)
    net = "true" if allow_internet else "false"
    (d / "task.toml").write_text(f'version = "1.0"\n[verifier]\ntimeout_sec = 60.0\n[agent]\ntimeout_sec = 120.0\n'
                                 f"[environment]\nallow_internet = {net}\n{toml_extra}")
    (d / "instruction.md").write_text(f"# {name}\nUpper-case input.txt into output.txt.\n")
    (d / "environment" / "Dockerfile").write_text(f"FROM {base}\nWORKDIR /app\nCOPY input.txt /app/\n{dockerfile_extra}")
    (d / "environment" / "input.txt").write_text("abc\n")
    (d / "tests" / "test.sh").write_text(HARBOR_TEST.format(check=check))
    (d / "tests" / "expected.txt").write_text("ABC\n")
    for rel, text in (test_files or {}).items():
        (d / "tests" / rel).write_text(text)
    (d / "solution" / "solve.sh").write_text(solution)
    return d


UPPER = "tr a-z A-Z < input.txt > output.txt\n"
SOLVED = '[ "$(cat output.txt 2>/dev/null)" = "$(cat /tests/expected.txt)" ]'
SOLVED_TB1 = '[ "$(cat output.txt 2>/dev/null)" = "$(cat "$TEST_DIR/expected.txt")" ]'


def checked_set(root: Path, base: str = "localhost/megathunder-base") -> dict[str, list[str]]:
    """Write the set; returns each task's expected problems (empty: ok)."""
    tb1_task(root, "tb1-good", base, check=SOLVED_TB1, solution=UPPER)
    harbor_task(root, "harbor-good", base, check=SOLVED, solution="#!/bin/bash\nset -euo pipefail\n"
                "mapfile -t lines < input.txt\nprintf '%s\\n' \"${lines[@]^^}\" > output.txt\n")  # bash only
    harbor_task(root, "harbor-false-positive", base, check="[ -e input.txt ]", solution=UPPER)
    harbor_task(root, "harbor-broken-oracle", base, check=SOLVED, solution="cp input.txt output.txt\n")
    return {"tb1-good": [], "harbor-good": [], "harbor-false-positive": ["false_positive"],
            "harbor-broken-oracle": ["broken_oracle"]}
