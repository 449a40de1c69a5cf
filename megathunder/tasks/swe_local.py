"""(c) SWE-style task: a small local Python repository with a failing test, generated offline.

The model reads, edits and runs code with the sandbox tools; the reward is 1 when the repository's
whole test suite passes. The verifier first restores the original test files, so editing a test
does not count as a fix. Tests use only the standard library (``unittest``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from megathunder.rollout.tools import BASH, READ_FILE, STR_REPLACE, WRITE_FILE
from megathunder.tasks.base import Task, TaskInstance, tool_call_text

TEST_COMMAND = "python3 -m unittest discover -s tests -t . -q"


@dataclass(frozen=True)
class _Repo:
    files: dict[str, str]
    tests: dict[str, str]
    module: str
    bug: str
    fix: str
    issue: str


def _clamp_repo(rng: random.Random) -> _Repo:
    hi = rng.randint(5, 50)
    src = (
        'def clamp(x, lo, hi):\n    """Limit x to the interval [lo, hi]."""\n'
        "    if x < lo:\n        return lo\n    if x > hi:\n        return lo\n    return x\n"
    )
    test = (
        "import unittest\n\nfrom intervals.clamp import clamp\n\n\nclass TestClamp(unittest.TestCase):\n"
        f"    def test_inside(self):\n        self.assertEqual(clamp(3, 0, {hi}), 3)\n\n"
        f"    def test_below(self):\n        self.assertEqual(clamp(-4, 0, {hi}), 0)\n\n"
        f"    def test_above(self):\n        self.assertEqual(clamp({hi + 7}, 0, {hi}), {hi})\n"
    )
    return _Repo(
        {"intervals/__init__.py": "", "intervals/clamp.py": src}, {"tests/__init__.py": "", "tests/test_clamp.py": test},
        "intervals/clamp.py", "    if x > hi:\n        return lo", "    if x > hi:\n        return hi",
        f"clamp(x, 0, {hi}) returns 0 instead of {hi} when x is above the interval.",
    )  # fmt: skip


def _mean_repo(rng: random.Random) -> _Repo:
    values = [rng.randint(1, 9) for _ in range(rng.randint(3, 6))]
    src = 'def mean(values):\n    """Arithmetic mean of a non-empty list."""\n    return sum(values) / (len(values) - 1)\n'
    test = (
        "import unittest\n\nfrom stats.summary import mean\n\n\nclass TestMean(unittest.TestCase):\n"
        f"    def test_mean(self):\n        self.assertAlmostEqual(mean({values}), {sum(values) / len(values)!r})\n\n"
        "    def test_constant(self):\n        self.assertEqual(mean([2, 2, 2, 2]), 2)\n"
    )
    return _Repo(
        {"stats/__init__.py": "", "stats/summary.py": src}, {"tests/__init__.py": "", "tests/test_summary.py": test},
        "stats/summary.py", "sum(values) / (len(values) - 1)", "sum(values) / len(values)",
        f"mean({values}) is wrong.",
    )  # fmt: skip


def _words_repo(rng: random.Random) -> _Repo:
    n = rng.randint(2, 6)
    text = "  ".join(["word"] * n)
    src = 'def count_words(text):\n    """Number of whitespace-separated words."""\n    return len(text.split(" "))\n'
    test = (
        "import unittest\n\nfrom text.words import count_words\n\n\nclass TestWords(unittest.TestCase):\n"
        f"    def test_double_spaces(self):\n        self.assertEqual(count_words({text!r}), {n})\n\n"
        "    def test_single(self):\n        self.assertEqual(count_words('a b c'), 3)\n"
    )
    return _Repo(
        {"text/__init__.py": "", "text/words.py": src}, {"tests/__init__.py": "", "tests/test_words.py": test},
        "text/words.py", 'len(text.split(" "))', "len(text.split())",
        f"count_words({text!r}) should be {n}.",
    )  # fmt: skip


_TEMPLATES = (_clamp_repo, _mean_repo, _words_repo)


class SweLocalTask(Task):
    name = "swe_local"
    system_prompt = (
        "You are a software engineer. Fix the bug in the repository in your working directory. "
        f"Run the tests with `{TEST_COMMAND}`. Reply without a tool call when you are done."
    )
    tools = (BASH, READ_FILE, WRITE_FILE, STR_REPLACE)
    verifies_in_sandbox = True

    def instances(self, num: int, seed: int = 0) -> list[TaskInstance]:
        rng = random.Random(seed)
        out = []
        for k in range(num):
            repo = _TEMPLATES[k % len(_TEMPLATES)](rng)
            out.append(
                TaskInstance(
                    f"swe-local-{seed}-{k}",
                    f"Issue: {repo.issue}\nThe failing test is in tests/. Fix the code, not the test.",
                    files={**repo.files, **repo.tests},
                    metadata={
                        "tests": repo.tests,
                        "module": repo.module,
                        "bug": repo.bug,
                        "fix": repo.fix,
                    },
                )
            )
        return out

    async def verify(self, inst, episode, sandbox) -> float:
        await sandbox.upload(inst.metadata["tests"])  # the original tests, whatever the model did
        return float((await sandbox.shell(TEST_COMMAND)).ok)

    def scripted_turns(self, inst: TaskInstance) -> list[str]:
        meta = inst.metadata
        return [
            "Let me look at the code.\n" + tool_call_text("read_file", path=meta["module"]),
            tool_call_text("bash", command=TEST_COMMAND),
            tool_call_text("str_replace", path=meta["module"], old=meta["bug"], new=meta["fix"]),
            tool_call_text("bash", command=TEST_COMMAND),
            "The tests pass now.",
        ]
