"""SWE records written for the tests in the published forms -- none is a benchmark's instance.

``classic_record`` makes a record in SWE-bench Verified's classic form (no eval script) for one of
its repositories: our own instance id, commit, patches and test names, in the shapes each
repository's harness uses (pytest ids, Django's and SymPy's runner names). ``smith_record`` makes a
SWE-smith record for one of the ``swesmith`` package's profiles.
"""

from __future__ import annotations

import json

VERIFIED_REPOS = {  # repository -> (a version in the 4.x harness's specs, a source file, a test file)
    "astropy/astropy": ("4.3", "astropy/units/quantity.py", "astropy/units/tests/test_quantity.py"),
    "django/django": ("4.0", "django/utils/text.py", "tests/utils_tests/test_text.py"),
    "matplotlib/matplotlib": ("3.5", "lib/matplotlib/colors.py", "lib/matplotlib/tests/test_colors.py"),
    "mwaskom/seaborn": ("0.12", "seaborn/_core/scales.py", "tests/_core/test_scales.py"),
    "pallets/flask": ("2.3", "src/flask/helpers.py", "tests/test_helpers.py"),
    "psf/requests": ("2.26", "requests/utils.py", "tests/test_utils.py"),
    "pydata/xarray": ("2022.06", "xarray/core/merge.py", "xarray/tests/test_merge.py"),
    "pylint-dev/pylint": ("2.15", "pylint/checkers/base.py", "tests/checkers/unittest_base.py"),
    "pytest-dev/pytest": ("7.2", "src/_pytest/python_api.py", "testing/python/approx.py"),
    "scikit-learn/scikit-learn": ("1.3", "sklearn/utils/validation.py", "sklearn/utils/tests/test_validation.py"),
    "sphinx-doc/sphinx": ("5.0", "sphinx/util/inspect.py", "tests/test_util_inspect.py"),
    "sympy/sympy": ("1.12", "sympy/core/numbers.py", "sympy/core/tests/test_numbers.py"),
}


def _diff(path: str, old: str, new: str) -> str:
    return (f"diff --git a/{path} b/{path}\n--- a/{path}\n+++ b/{path}\n@@ -1,2 +1,2 @@\n"
            f" # megathunder test fixture\n-{old}\n+{new}\n")


def _test_names(repo: str, test_file: str) -> tuple[list[str], list[str]]:
    if repo == "django/django":
        module = test_file.removeprefix("tests/").removesuffix(".py").replace("/", ".")
        return ([f"test_fixture_new ({module}.FixtureTests.test_fixture_new)"],
                [f"test_fixture_old ({module}.FixtureTests.test_fixture_old)"])
    if repo == "sympy/sympy":
        return ["test_fixture_new"], ["test_fixture_old"]
    return [f"{test_file}::test_fixture_new"], [f"{test_file}::test_fixture_old"]


def classic_record(repo: str, number: int = 90001) -> dict:
    """A SWE-bench record in the classic form (as SWE-bench Verified was first released)."""
    version, source, test_file = VERIFIED_REPOS[repo]
    f2p, p2p = _test_names(repo, test_file)
    owner, name = repo.split("/")
    return {
        "repo": repo, "instance_id": f"{owner}__{name}-{number}", "base_commit": f"{number:040x}",
        "patch": _diff(source, "value = compute(x) + 1", "value = compute(x)"),
        "test_patch": _diff(test_file, "def test_fixture_old(): pass", "def test_fixture_new(): assert compute(1) == 1"),
        "problem_statement": f"compute() is off by one in {source}.", "hints_text": "", "created_at": "2025-01-01T00:00:00Z",
        "version": version, "FAIL_TO_PASS": json.dumps(f2p), "PASS_TO_PASS": json.dumps(p2p),
        "environment_setup_commit": f"{number + 1:040x}",
    }  # fmt: skip


def smith_record(repo_name: str, suffix: str, f2p: list[str], p2p: list[str]) -> dict:
    """A SWE-smith record (``repo_name``: a ``swesmith`` profile's, e.g. ``mewwts__addict.75284f95``)."""
    return {
        "instance_id": f"{repo_name}.{suffix}", "repo": f"swesmith/{repo_name}",
        "patch": _diff("src/module.py", "return a + b", "return a - b"),
        "FAIL_TO_PASS": f2p, "PASS_TO_PASS": p2p, "created_at": "2025-01-01T00:00:00Z",
        "image_name": "unused", "base_commit": "0" * 40, "problem_statement": "add() subtracts.",
    }  # fmt: skip
