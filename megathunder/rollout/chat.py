"""ChatML (Qwen-style) chat template on token ids, and Hermes/Qwen tool-call parsing.

Layout of an episode, every piece appended to one running id list and never re-tokenised:

    <|im_start|>system\n{system + tool schemas}<|im_end|>\n<|im_start|>user\n{task}<|im_end|>\n
    <|im_start|>assistant\n                                              <- prompt (masked)
    {model turn 1, ending in <|im_end|>}                                  <- generated (trained)
    \n<|im_start|>user\n<tool_response>\n{output}\n</tool_response><|im_end|>\n<|im_start|>assistant\n
                                                                          <- tool output (masked)
    {model turn 2} ...

A tool call is the documented Hermes/Qwen format, one or more per turn:

    <tool_call>
    {"name": "bash", "arguments": {"command": "ls"}}
    </tool_call>

Text that came from outside the model (tool output, task text) is encoded with its special-token
strings taken literally, so a tool printing ``<|im_end|>`` cannot close the turn.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
SPECIAL_TOKENS = (IM_START, IM_END, TOOL_CALL_OPEN, TOOL_CALL_CLOSE, "<|endoftext|>")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ToolCallError:
    """A tool call the model wrote that cannot be run; its message goes back to the model."""

    message: str


class ChatCodec:
    """Token-id chat template over a ``tokenizers.Tokenizer`` or a transformers fast tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        # transformers' fast tokenizers wrap a ``tokenizers.Tokenizer``; use it directly so both
        # kinds behave the same (no automatic BOS/EOS, special tokens matched in trusted text).
        self._tok = getattr(tokenizer, "backend_tokenizer", tokenizer)
        self.im_start_id = self._special_id(IM_START)
        self.im_end_id = self._special_id(IM_END)
        self._specials = [s for s in SPECIAL_TOKENS if self._tok.token_to_id(s) is not None]

    def _special_id(self, token: str) -> int:
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise ValueError(f"tokenizer has no {token!r} token; the ChatML template needs it")
        return token_id

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode_trusted(self, text: str) -> list[int]:
        """Encode text whose special-token strings are meant as special tokens (the template)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_literal(self, text: str) -> list[int]:
        """Encode untrusted text: each special-token string in it becomes ordinary tokens."""
        if not any(s in text for s in self._specials):
            return self.encode_trusted(text)
        pattern = "(" + "|".join(re.escape(s) for s in self._specials) + ")"
        ids: list[int] = []
        for k, piece in enumerate(re.split(pattern, text)):
            if k % 2:  # a special-token string: split it so no added token matches
                ids += self.encode_trusted(piece[:-1]) + self.encode_trusted(piece[-1:])
            elif piece:
                ids += self.encode_trusted(piece)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def prompt_ids(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """The prompt: every message, then the assistant header the model continues from."""
        ids: list[int] = []
        for msg in messages:
            ids += [self.im_start_id] + self.encode_trusted(f"{msg['role']}\n")
            ids += (
                self.encode_literal(msg["content"]) + [self.im_end_id] + self.encode_trusted("\n")
            )
        return ids + self.assistant_header_ids()

    def assistant_header_ids(self) -> list[int]:
        return [self.im_start_id] + self.encode_trusted("assistant\n")

    def tool_response_ids(self, outputs: Sequence[str]) -> list[int]:
        """After a model turn (which ended in <|im_end|>): the tool outputs, then the next header."""
        ids = self.encode_trusted("\n") + [self.im_start_id] + self.encode_trusted("user\n")
        for k, out in enumerate(outputs):
            sep = "\n" if k else ""
            ids += self.encode_trusted(f"{sep}<tool_response>\n") + self.encode_literal(out)
            ids += self.encode_trusted("\n</tool_response>")
        return ids + [self.im_end_id] + self.encode_trusted("\n") + self.assistant_header_ids()


def tools_system_prompt(system: str, tool_schemas: Sequence[Mapping[str, Any]]) -> str:
    """Qwen2.5's tool preamble: JSON schemas inside <tools>, and how to call them."""
    if not tool_schemas:
        return system
    schemas = "\n".join(json.dumps({"type": "function", "function": s}) for s in tool_schemas)
    return (
        f"{system}\n\n# Tools\n\nYou may call one or more functions to assist with the user query."
        f"\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        f"{schemas}\n</tools>\n\nFor each function call, return a json object with function name "
        "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


_CALL_RE = re.compile(
    re.escape(TOOL_CALL_OPEN) + r"(.*?)(" + re.escape(TOOL_CALL_CLOSE) + r"|$)", re.S
)


def parse_tool_calls(text: str) -> list[ToolCall | ToolCallError]:
    """Every ``<tool_call>`` block of a model turn, in order; a malformed one becomes an error.

    ``arguments`` may be a JSON object or (as some models write it) a string holding one.
    """
    calls: list[ToolCall | ToolCallError] = []
    for match in _CALL_RE.finditer(text):
        body, close = match.group(1).strip(), match.group(2)
        if not close:
            calls.append(ToolCallError(f"tool call not closed: missing {TOOL_CALL_CLOSE}"))
            continue
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as err:
            calls.append(
                ToolCallError(f"tool call is not valid JSON ({err.msg} at char {err.pos})")
            )
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            calls.append(ToolCallError('tool call must be a JSON object with a string "name"'))
            continue
        args = obj.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                pass
        if not isinstance(args, dict):
            calls.append(
                ToolCallError(f'tool call {obj["name"]!r}: "arguments" must be a JSON object')
            )
            continue
        calls.append(ToolCall(obj["name"], args))
    if not calls and TOOL_CALL_CLOSE in text:
        calls.append(ToolCallError(f"found {TOOL_CALL_CLOSE} without a matching {TOOL_CALL_OPEN}"))
    return calls
