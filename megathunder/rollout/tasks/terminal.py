"""(d) Terminal task: reach a goal state of the work directory with shell commands.

The verifier runs the instance's check command in the sandbox and compares its output with the
expected one (reward 1 on a match).
"""

from __future__ import annotations

import random

from megathunder.rollout.tasks.task import Task, TaskInstance, tool_call_text
from megathunder.rollout.tools import BASH


def _count_errors(rng: random.Random) -> tuple[str, dict, str, str, str]:
    lines = [
        rng.choice(["INFO ok", "ERROR disk full", "WARN slow", "ERROR timeout"])
        for _ in range(rng.randint(5, 20))
    ]
    count = sum(line.startswith("ERROR") for line in lines)
    log = f"app{rng.randint(1, 999)}.log"
    return (
        f"Write the number of lines of {log} that contain ERROR into result.txt.",
        {log: "\n".join(lines) + "\n"}, "cat result.txt", str(count),
        f"grep -c ERROR {log} > result.txt",
    )  # fmt: skip


def _rename_logs(rng: random.Random) -> tuple[str, dict, str, str, str]:
    names = sorted({f"run{rng.randint(0, 99)}" for _ in range(rng.randint(2, 5))})
    folder = f"logs{rng.randint(1, 999)}"
    files = {f"{folder}/{n}.log": f"{n}\n" for n in names}
    return (
        f"Rename every .log file in {folder}/ to the same name with the extension .txt.",
        files, f"ls {folder}", "\n".join(f"{n}.txt" for n in names),
        f'cd {folder} && for f in *.log; do mv "$f" "${{f%.log}}.txt"; done',
    )  # fmt: skip


def _sort_unique(rng: random.Random) -> tuple[str, dict, str, str, str]:
    names = [rng.choice(["ada", "bob", "cy", "dee", "eve"]) for _ in range(rng.randint(4, 10))]
    src = f"names{rng.randint(1, 999)}.txt"
    return (
        f"Write the distinct lines of {src}, sorted, to unique.txt.",
        {src: "\n".join(names) + "\n"}, "cat unique.txt", "\n".join(sorted(set(names))),
        f"sort -u {src} > unique.txt",
    )  # fmt: skip


_GOALS = (_count_errors, _rename_logs, _sort_unique)


class TerminalTask(Task):
    name = "terminal"
    system_prompt = (
        "You operate a Linux shell in your working directory. Reply without a tool call when done."
    )
    tools = (BASH,)
    verifies_in_sandbox = True

    def instances(self, num: int, seed: int = 0) -> list[TaskInstance]:
        rng = random.Random(seed)
        out = []
        for k in range(num):
            goal, files, check, expect, solution = _GOALS[k % len(_GOALS)](rng)
            meta = {"check": check, "expect": expect, "solution": solution}
            out.append(TaskInstance(f"terminal-{seed}-{k}", goal, files=files, metadata=meta))
        return out

    async def verify(self, inst, episode, sandbox) -> float:
        result = await sandbox.shell(inst.metadata["check"])
        return float(result.ok and result.output.strip() == inst.metadata["expect"])

    def scripted_turns(self, inst: TaskInstance) -> list[str]:
        return [tool_call_text("bash", command=inst.metadata["solution"]), "Done."]
