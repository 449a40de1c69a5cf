"""Chat codecs: a conversation as token ids, built once and never re-tokenised.

``ChatCodec`` is what the agent loop needs from a chat format: the prompt, the tokens that close
a model turn, the tokens between a turn and the next (tool outputs, then the next generation
header), and how tool calls are written. Two implementations (``agent.chat_template``):

    chatml   ``ChatMLCodec`` below: ChatML written out by hand, Hermes/Qwen tool calls
    model    ``megathunder.rollout.chat_template.TemplateCodec``: the model's own chat template
             (``apply_chat_template``), checked to be incremental at start

ChatML layout of an episode, every piece appended to one running id list:

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

import abc
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
MEMO_MAX_TEXT = 1 << 16
"""``encode_trusted`` remembers the ids of texts up to this many characters (a batch's prompts, the
template's pieces: the same few texts every step, in every sample of a group)..."""
MEMO_MAX_CHARS = 1 << 24
"""... and forgets them all once the texts it holds pass this many characters in all."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ToolCallError:
    """A tool call the model wrote that cannot be run; its message goes back to the model."""

    message: str


class ChatCodec(abc.ABC):
    """A chat format on token ids over a ``tokenizers.Tokenizer`` or a transformers fast tokenizer."""

    end_of_turn_id: int
    """The token that closes a model turn (appended, masked, when the engine stopped without it)."""

    def __init__(self, tokenizer: Any, specials: Sequence[str]) -> None:
        # transformers' fast tokenizers wrap a ``tokenizers.Tokenizer``; use it directly so both
        # kinds behave the same (no automatic BOS/EOS, special tokens matched in trusted text).
        self._tok = getattr(tokenizer, "backend_tokenizer", tokenizer)
        self._specials = sorted({s for s in specials if self._tok.token_to_id(s) is not None}, key=len, reverse=True)
        self._memo: dict[str, tuple[int, ...]] = {}
        self._memo_chars = 0

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """What ends a model turn when sampled."""
        return (self.end_of_turn_id,)

    def encode_trusted(self, text: str) -> list[int]:
        """Encode text whose special-token strings are meant as special tokens (the template)."""
        ids = self._memo.get(text)
        if ids is None:
            ids = tuple(self._tok.encode(text, add_special_tokens=False).ids)
            if len(text) <= MEMO_MAX_TEXT:  # the tokenizer is a pure function of the text
                if self._memo_chars + len(text) > MEMO_MAX_CHARS:
                    self._memo.clear()
                    self._memo_chars = 0
                self._memo[text] = ids
                self._memo_chars += len(text)
        return list(ids)

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

    def turn_text(self, ids: Sequence[int]) -> str:
        """A model turn's text, without the token that closed it."""
        if ids and ids[-1] in self.stop_token_ids:
            ids = ids[:-1]
        return self.decode(ids)

    @property
    @abc.abstractmethod
    def generation_header(self) -> str:
        """The text the assistant's turn starts after (ChatML: ``<|im_start|>assistant\\n``)."""

    @abc.abstractmethod
    def prompt_ids(self, messages: Sequence[Mapping[str, str]],
                   tools: Sequence[Mapping[str, Any]] = ()) -> list[int]:
        """The prompt: every message (the tools' schemas as the format declares them), then the
        assistant header the model continues from."""

    @abc.abstractmethod
    def tool_response_ids(self, outputs: Sequence[str]) -> list[int]:
        """After a model turn (closed by ``end_of_turn_id``): the tool outputs, then the next header."""

    def parse_tool_calls(self, text: str) -> list[ToolCall | ToolCallError]:
        """The tool calls of a model turn's text (Hermes/Qwen ``<tool_call>`` blocks)."""
        return parse_tool_calls(text)


class ChatMLCodec(ChatCodec):
    """ChatML written out by hand (module docstring); needs ``<|im_start|>`` and ``<|im_end|>``."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer, SPECIAL_TOKENS)
        self.im_start_id = self._special_id(IM_START)
        self.im_end_id = self.end_of_turn_id = self._special_id(IM_END)

    def _special_id(self, token: str) -> int:
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise ValueError(f"agent.chat_template: the tokenizer has no {token!r} token, which chatml needs; "
                             "use agent.chat_template=model (the model's own chat template)")
        return token_id

    def prompt_ids(self, messages: Sequence[Mapping[str, str]],
                   tools: Sequence[Mapping[str, Any]] = ()) -> list[int]:
        ids: list[int] = []
        for k, msg in enumerate(messages):
            content = msg["content"]
            if k == 0 and msg["role"] == "system":
                content = tools_system_prompt(content, tools)
            ids += [self.im_start_id] + self.encode_trusted(f"{msg['role']}\n")
            ids += self.encode_literal(content) + [self.im_end_id] + self.encode_trusted("\n")
        return ids + self.assistant_header_ids()

    @property
    def generation_header(self) -> str:
        return f"{IM_START}assistant\n"

    def assistant_header_ids(self) -> list[int]:
        return [self.im_start_id] + self.encode_trusted("assistant\n")

    def tool_response_ids(self, outputs: Sequence[str]) -> list[int]:
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
