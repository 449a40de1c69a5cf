"""(b) Calculator: a multi-step expression the model evaluates with the ``calculator`` tool over
several turns, then answers; reward 1 when the last number of the answer is right."""

from __future__ import annotations

import random

from megathunder.rollout.tasks.task import Task, TaskInstance, last_number, tool_call_text
from megathunder.rollout.tools import CALCULATOR


class CalculatorTask(Task):
    name = "calculator"
    system_prompt = "Use the calculator for every step, then give the final number."
    tools = (CALCULATOR,)

    def __init__(self, max_operand: int = 20) -> None:
        self.max_operand = max_operand

    def instances(self, num: int, seed: int = 0) -> list[TaskInstance]:
        rng = random.Random(seed)
        out = []
        for k in range(num):
            a, b, c, d = (rng.randint(1, self.max_operand) for _ in range(4))
            steps = [f"{a} * {b}", f"{a * b} + {c}", f"{a * b + c} - {d}"]
            out.append(
                TaskInstance(
                    f"calc-{seed}-{k}",
                    f"Compute ({a} * {b} + {c}) - {d}.",
                    a * b + c - d,
                    metadata={"steps": steps},
                )  # fmt: skip
            )
        return out

    async def verify(self, inst, episode, sandbox) -> float:
        return float(last_number(episode.final_text) == inst.answer)

    def scripted_turns(self, inst: TaskInstance) -> list[str]:
        turns = [tool_call_text("calculator", expression=s) for s in inst.metadata["steps"]]
        return turns + [f"The answer is {inst.answer}."]
