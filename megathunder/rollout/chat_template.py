"""The model's own chat template (``agent.chat_template: model``), made incremental on token ids.

A multi-turn episode is one running id list: the prompt, then for each turn the tokens the model
generated (kept exactly as sampled, never re-tokenised) and the tokens between that turn and the
next. Templates render whole conversations, so ``TemplateCodec`` derives the pieces from renders
of probe conversations (placeholders for every message's content) and checks, at start, that the
pieces compose -- that rendering a conversation one turn longer only appends:

    generation header   render(msgs, add_generation_prompt) = render(msgs) + H
    a model turn        render(msgs + [assistant P]) = render(msgs) + H + P + <end of turn> + glue
    the next turn       render(msgs + [assistant P, tool T...], add_generation_prompt)
                          = render(msgs + [assistant P]) + tool pieces + H

checked over three rounds (so a template that rewrites earlier assistant turns -- Qwen3 dropping
old ``<think>`` blocks -- is found). A template that fails a check is refused with the reason;
``agent.chat_template: chatml`` is the hand-written alternative. Contents (task text, tool
outputs) are encoded literally between the template's own pieces, so a tool printing a special
token cannot close the turn, and the template's pieces keep their special tokens.

Tool schemas go through the template's ``tools`` argument (its native preamble). Tool calls are
parsed in the model's native format: ``agent.tool_parser: hermes`` (``<tool_call>`` JSON blocks,
malformed calls reported back to the model) or any of vLLM's tool parsers by name
(``llama3_json``, ``qwen3_xml``, ``mistral``, ...), run on each finished turn's text.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from megathunder.rollout.chat import ChatCodec, ChatMLCodec, ToolCall, ToolCallError, parse_tool_calls

_CONTENT = "\x00mt{}\x00"  # a placeholder no template alters (no whitespace to trim, no markup)
_SPLIT = re.compile("\x00mt(\\d+)\x00")
_PROBE_TOOLS = [{"type": "function", "function": {
    "name": "probe_tool", "description": "d",
    "parameters": {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}}}]


class TemplateError(ValueError):
    """The chat template cannot be used incrementally; the message says why."""


class TemplateCodec(ChatCodec):
    """``apply_chat_template`` as composable pieces (module docstring)."""

    def __init__(self, tokenizer: Any, tool_parser: str = "hermes") -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError("agent.chat_template: model, but the tokenizer has no chat template; "
                                "use agent.chat_template=chatml")
        super().__init__(tokenizer, list(getattr(tokenizer, "all_special_tokens", ())) +
                         [t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values()])
        self._hf = tokenizer
        self._check_and_derive()
        self._parser = None if tool_parser == "hermes" else _vllm_parser(tokenizer, tool_parser)

    # ------------------------------------------------------------------ the pieces

    def _render(self, messages: Sequence[Mapping[str, Any]], generation: bool, tools=None) -> str:
        try:
            return self._hf.apply_chat_template(list(messages), tools=tools or None, tokenize=False,
                                                add_generation_prompt=generation)
        except Exception as err:  # jinja raises its own kinds (a template's raise_exception)
            raise TemplateError(f"agent.chat_template: the model's template failed on a plain "
                                f"conversation: {err}") from None

    def _check_and_derive(self) -> None:
        sys_user = [{"role": "system", "content": _CONTENT.format(0)}, {"role": "user", "content": _CONTENT.format(1)}]
        base = self._render(sys_user, False)
        prompt = self._render(sys_user, True)
        if not prompt.startswith(base) or prompt == base:
            raise TemplateError("agent.chat_template: the template's generation prompt does not extend the "
                                "conversation (add_generation_prompt changes what precedes it)")
        self._header = prompt[len(base):]
        convo, rendered = list(sys_user), prompt
        for k in range(3):  # three rounds: turn, tool outputs, next header
            turn = _CONTENT.format(10 + k)
            convo.append({"role": "assistant", "content": turn})
            closed = self._render(convo, False)
            if not closed.startswith(rendered + turn):
                raise TemplateError(f"agent.chat_template: the template re-renders earlier turns (round {k + 1}: "
                                    "the conversation so far is not a prefix of the next render), so generated "
                                    "tokens could not be kept as sampled; use agent.chat_template=chatml")
            after = closed[len(rendered + turn):]
            end = self._end_of_turn(after)
            if k == 0:
                self.end_of_turn_id, self._end_text, self._glue = self._tok.token_to_id(end), end, after[len(end):]
            elif (end, after[len(end):]) != (self._end_text, self._glue):
                raise TemplateError("agent.chat_template: the template closes later turns differently")
            convo.append({"role": "tool", "content": _CONTENT.format(20 + k)})
            rendered = self._render(convo, True)
            if not rendered.startswith(closed):
                raise TemplateError(f"agent.chat_template: the template re-renders earlier turns when a tool output "
                                    f"follows them (round {k + 1}), so generated tokens could not be kept as sampled; "
                                    "use agent.chat_template=chatml")
            if not rendered.endswith(self._header):
                raise TemplateError("agent.chat_template: after a tool output the template does not end in its "
                                    "generation header")
            between = rendered[len(closed): -len(self._header)]
            if k == 0:
                self._tool_open, self._tool_close = between.split(_CONTENT.format(20))
            elif between != self._tool_open + _CONTENT.format(20 + k) + self._tool_close:
                raise TemplateError("agent.chat_template: the template renders later tool outputs differently")
        two = self._render(convo[:3] + [{"role": "tool", "content": _CONTENT.format(20)},
                                        {"role": "tool", "content": _CONTENT.format(21)}], True)
        one = self._render(convo[:3], False)
        self._multi_tool = two[len(one):-len(self._header)] if two.startswith(one) else None

    def _end_of_turn(self, after: str) -> str:
        """The special token a template puts right after an assistant message's content."""
        for token in self._specials:
            if after.startswith(token):
                return token
        raise TemplateError(f"agent.chat_template: the template closes an assistant turn with {after[:20]!r}, "
                            "not a special token the model can sample")

    @property
    def generation_header(self) -> str:
        return self._header

    @property
    def glue_after_turn(self) -> str:
        """What the template writes after a turn's end-of-turn token (ChatML: a newline); the tokens
        of the next piece (``tool_response_ids``) start with it."""
        return self._glue

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        eos = getattr(self._hf, "eos_token_id", None)
        return (self.end_of_turn_id,) + ((eos,) if eos is not None and eos != self.end_of_turn_id else ())

    def _encode(self, text: str, contents: Sequence[str]) -> list[int]:
        """``text`` with placeholders: template pieces trusted, contents literal."""
        ids: list[int] = []
        for k, piece in enumerate(_SPLIT.split(text)):
            if k % 2:
                ids += self.encode_literal(contents[int(piece)])
            elif piece:
                ids += self.encode_trusted(piece)
        return ids

    # ------------------------------------------------------------------ ChatCodec

    def prompt_ids(self, messages: Sequence[Mapping[str, str]], tools: Sequence[Mapping[str, Any]] = ()) -> list[int]:
        contents = [m["content"] for m in messages]
        probe = [{**m, "content": _CONTENT.format(k)} for k, m in enumerate(messages)]
        schemas = [{"type": "function", "function": dict(t)} for t in tools]
        return self._encode(self._render(probe, True, schemas), contents)

    def tool_response_ids(self, outputs: Sequence[str]) -> list[int]:
        if len(outputs) > 1 and self._multi_tool is None:
            raise TemplateError("agent.chat_template: the template cannot render several tool outputs of one turn")
        if len(outputs) <= 1:
            pieces = self._tool_open + _CONTENT.format(0) + self._tool_close if outputs else ""
        else:  # consecutive tool messages may share one wrapper (ChatML's user turn): render them
            convo = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
            convo += [{"role": "tool", "content": _CONTENT.format(k)} for k in range(len(outputs))]
            before = self._render(convo[:2], False)
            rendered = self._render(convo, True)
            pieces = rendered[len(before):-len(self._header)]
        return self._encode(self._glue + pieces + self._header, list(outputs))

    def parse_tool_calls(self, text: str) -> list[ToolCall | ToolCallError]:
        if self._parser is None:
            return parse_tool_calls(text)
        return self._parser(text)


def _vllm_parser(tokenizer: Any, name: str):
    """vLLM's tool parser ``name`` on a turn's text: its calls, or none (a malformed call is text)."""
    import json

    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers import ToolParserManager

    try:
        parser = ToolParserManager.get_tool_parser(name)(tokenizer)
    except KeyError:
        raise TemplateError(f"agent.tool_parser: vLLM has no tool parser {name!r}") from None
    request = ChatCompletionRequest(messages=[], model="megathunder", tools=_PROBE_TOOLS)

    def parse(text: str) -> list[ToolCall | ToolCallError]:
        info = parser.extract_tool_calls(text, request)
        calls: list[ToolCall | ToolCallError] = []
        for call in info.tool_calls if info.tools_called else []:
            try:
                args = json.loads(call.function.arguments or "{}")
            except json.JSONDecodeError as err:
                calls.append(ToolCallError(f"tool call {call.function.name!r}: arguments are not JSON ({err.msg})"))
                continue
            calls.append(ToolCall(call.function.name, args) if isinstance(args, dict) else
                         ToolCallError(f'tool call {call.function.name!r}: "arguments" must be a JSON object'))
        return calls

    return parse


def make_codec(tokenizer: Any, chat_template: str = "chatml", tool_parser: str = "hermes") -> ChatCodec:
    """The codec ``agent.chat_template`` names, over a transformers tokenizer."""
    if chat_template == "chatml":
        return ChatMLCodec(tokenizer)
    return TemplateCodec(tokenizer, tool_parser)
