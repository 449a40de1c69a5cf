"""Tools a model can call. Each returns the observation text the model sees next: failures and
limits become error observations, and the agent loop turns bad arguments or an exception raised by
a tool into one too, so a tool never ends an episode.

Sandbox tools (``bash``, ``read_file``, ``write_file``, ``str_replace``) run everything inside
the episode's sandbox (``bash`` under bash, not ``sh``: benchmark tasks are written for it); ``calculator`` is pure and runs in-process on a restricted expression tree.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from megathunder.rollout.sandbox import Sandbox

STR_REPLACE_MAX_BYTES = 4 << 20  # str_replace reads the whole file, past the output limit


class ToolArgumentError(ValueError):
    pass


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: Mapping[str, str]  # argument name -> description; all are required strings
    run: Callable[[Sandbox | None, Mapping[str, str]], Awaitable[str]]
    needs_sandbox: bool = True

    def schema(self) -> dict[str, Any]:
        """The function schema shown to the model (Qwen/OpenAI function-calling shape)."""
        return {
            "name": self.name,
            "description": self.description,
            "parameters": {
                "type": "object",
                "properties": {
                    k: {"type": "string", "description": v} for k, v in self.parameters.items()
                },
                "required": list(self.parameters),
            },
        }

    def check_arguments(self, args: Mapping[str, Any]) -> dict[str, str]:
        missing = [k for k in self.parameters if k not in args]
        if missing:
            raise ToolArgumentError(f"tool {self.name!r}: missing argument(s) {', '.join(missing)}")
        unknown = [k for k in args if k not in self.parameters]
        if unknown:
            raise ToolArgumentError(
                f"tool {self.name!r}: unknown argument(s) {', '.join(unknown)}; expected "
                f"{', '.join(self.parameters)}"
            )
        bad = [k for k, v in args.items() if not isinstance(v, str)]
        if bad:
            raise ToolArgumentError(
                f"tool {self.name!r}: argument(s) {', '.join(bad)} must be strings"
            )
        return dict(args)


def _in_sandbox(sb: Sandbox | None) -> Sandbox:
    """The episode's sandbox, which every episode whose task has a sandbox tool gets."""
    if sb is None:
        raise RuntimeError("a sandbox tool was called in an episode without a sandbox")
    return sb


async def _bash(sb: Sandbox | None, args: Mapping[str, str]) -> str:
    result = await _in_sandbox(sb).bash(args["command"])  # bash, as the benchmarks' agents have it
    return result.observation() or f"[exit code {result.exit_code}, no output]"


async def _read_file(sb: Sandbox | None, args: Mapping[str, str]) -> str:
    return (await _in_sandbox(sb).read_file(args["path"])).observation()


async def _write_file(sb: Sandbox | None, args: Mapping[str, str]) -> str:
    result = await _in_sandbox(sb).write_file(args["path"], args["content"])
    return (
        result.observation()
        if not result.ok
        else f"wrote {len(args['content'])} characters to {args['path']}"
    )


async def _str_replace(sb: Sandbox | None, args: Mapping[str, str]) -> str:
    sb = _in_sandbox(sb)
    path, old, new = args["path"], args["old"], args["new"]
    read = await sb.read_file(path, max_bytes=STR_REPLACE_MAX_BYTES)
    if not read.ok:
        return read.observation()
    if read.output_truncated:
        return f"[error: {path} is larger than {STR_REPLACE_MAX_BYTES} bytes; edit it with bash]"
    count = read.output.count(old)
    if count != 1:
        return f"[error: the text to replace occurs {count} times in {path}; it must occur exactly once]"
    written = await sb.write_file(path, read.output.replace(old, new))
    return written.observation() if not written.ok else f"replaced 1 occurrence in {path}"


_BINOPS: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}  # fmt: skip
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def safe_eval(expression: str) -> int | float:
    """Arithmetic on numbers only (+ - * / // % **, parentheses); exponents bounded."""

    def ev(node: ast.AST) -> int | float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large (at most 64)")
            return _BINOPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](ev(node.operand))
        raise ValueError(f"unsupported expression element: {type(node).__name__}")

    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")
    return ev(ast.parse(expression, mode="eval"))


async def _calculator(sb: Sandbox | None, args: Mapping[str, str]) -> str:
    del sb
    try:
        value = safe_eval(args["expression"])
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as err:
        return f"[error: cannot evaluate {args['expression']!r}: {err}]"
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


BASH = Tool("bash", "Run a shell command in the work directory.", {"command": "the command"}, _bash)
READ_FILE = Tool("read_file", "Print a file.", {"path": "file path"}, _read_file)
WRITE_FILE = Tool(
    "write_file",
    "Create or overwrite a file.",
    {"path": "file path", "content": "new content"},
    _write_file,
)
STR_REPLACE = Tool(
    "str_replace",
    "Replace the one occurrence of `old` in a file by `new`.",
    {"path": "file path", "old": "exact text to replace", "new": "replacement text"},
    _str_replace,
)
CALCULATOR = Tool(
    "calculator", "Evaluate an arithmetic expression.", {"expression": "e.g. (3 + 4) * 5"},
    _calculator, needs_sandbox=False,
)  # fmt: skip
