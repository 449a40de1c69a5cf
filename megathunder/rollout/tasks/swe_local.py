"""(c) SWE-style task: a small local Python repository with a failing test, generated offline.

The model reads, edits and runs code with the sandbox tools; the reward is 1 when the repository's
whole test suite passes. The verifier first restores the original test files, so editing a test
does not count as a fix. Tests use only the standard library (``unittest``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from textwrap import dedent

from megathunder.rollout.tasks.task import Task, TaskInstance, tool_call_text
from megathunder.rollout.tools import BASH, READ_FILE, STR_REPLACE, WRITE_FILE

TEST_COMMAND = "python3 -m unittest discover -s tests -t . -q"


@dataclass(frozen=True)
class _Repo:
    files: dict[str, str]
    tests: dict[str, str]
    module: str
    bug: str
    fix: str
    issue: str


def _repo(package: str, module: str, src: str, test: str, bug: str, fix: str, issue: str) -> _Repo:
    src = dedent(src)
    assert src.count(bug) == 1, "the bug must be a unique span of the module"
    path, test_path = f"{package}/{module}.py", f"tests/test_{module}.py"
    files = {f"{package}/__init__.py": "", path: src}
    return _Repo(files, {"tests/__init__.py": "", test_path: dedent(test)}, path, bug, fix, issue)


def _clamp_repo(rng: random.Random) -> _Repo:
    hi = rng.randint(5, 50)
    src = """\
        def clamp(x, lo, hi):
            \"\"\"Limit x to the interval [lo, hi].\"\"\"
            if x < lo:
                return lo
            if x > hi:
                return lo
            return x
        """
    test = f"""\
        import unittest

        from intervals.clamp import clamp


        class TestClamp(unittest.TestCase):
            def test_inside(self):
                self.assertEqual(clamp(3, 0, {hi}), 3)

            def test_below(self):
                self.assertEqual(clamp(-4, 0, {hi}), 0)

            def test_above(self):
                self.assertEqual(clamp({hi + 7}, 0, {hi}), {hi})
        """
    bug, fix = "if x > hi:\n        return lo", "if x > hi:\n        return hi"
    issue = f"clamp(x, 0, {hi}) returns 0 instead of {hi} when x is above the interval."
    return _repo("intervals", "clamp", src, test, bug, fix, issue)


def _mean_repo(rng: random.Random) -> _Repo:
    values = [rng.randint(1, 9) for _ in range(rng.randint(3, 6))]
    src = """\
        def mean(values):
            \"\"\"Arithmetic mean of a non-empty list.\"\"\"
            return sum(values) / (len(values) - 1)
        """
    test = f"""\
        import unittest

        from stats.summary import mean


        class TestSummary(unittest.TestCase):
            def test_mean(self):
                self.assertAlmostEqual(mean({values}), {sum(values) / len(values)!r})

            def test_constant(self):
                self.assertEqual(mean([2, 2, 2, 2]), 2)
        """
    bug, fix = "sum(values) / (len(values) - 1)", "sum(values) / len(values)"
    return _repo("stats", "summary", src, test, bug, fix, f"mean({values}) is wrong.")


def _words_repo(rng: random.Random) -> _Repo:
    n = rng.randint(2, 6)
    text = "  ".join(["word"] * n)
    src = """\
        def count_words(text):
            \"\"\"Number of whitespace-separated words.\"\"\"
            return len(text.split(" "))
        """
    test = f"""\
        import unittest

        from text.words import count_words


        class TestWords(unittest.TestCase):
            def test_double_spaces(self):
                self.assertEqual(count_words({text!r}), {n})

            def test_single(self):
                self.assertEqual(count_words("a b c"), 3)
        """
    bug, fix = 'len(text.split(" "))', "len(text.split())"
    return _repo("text", "words", src, test, bug, fix, f"count_words({text!r}) should be {n}.")


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
