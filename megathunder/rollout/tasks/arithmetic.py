"""(a) Arithmetic: one turn, no tools; reward 1 when the last number of the answer is right.

Small operands and a fixed answer format, so a tiny model can learn it on a CPU (the quickstart).
"""

from __future__ import annotations

import random

from megathunder.rollout.tasks.task import Task, TaskInstance, last_number


class ArithmeticTask(Task):
    name = "arithmetic"
    system_prompt = "Answer with the number only."

    def __init__(self, max_operand: int = 20) -> None:
        self.max_operand = max_operand

    def instances(self, num: int, seed: int = 0) -> list[TaskInstance]:
        rng = random.Random(seed)
        out = []
        for k in range(num):
            a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
            op = rng.choice("+-")
            out.append(
                TaskInstance(f"arith-{seed}-{k}", f"{a} {op} {b} =", a + b if op == "+" else a - b)
            )
        return out

    async def verify(self, inst, episode, sandbox) -> float:
        return float(last_number(episode.final_text) == inst.answer)

    def scripted_turns(self, inst: TaskInstance) -> list[str]:
        return [str(inst.answer)]
