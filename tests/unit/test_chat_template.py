"""The model's own chat template on token ids (``agent.chat_template: model``).

Two template families, each with native tool calls: ChatML with Hermes calls (the built-in tiny
model's template, as Qwen2.5 and SmolLM2 write it) and Llama 3 (header tokens, ``<|eot_id|>``,
tool outputs in the ``ipython`` role, JSON calls read by vLLM's ``llama3_json`` parser; the
template is written here in Llama 3.1's documented prompt format). A scripted policy plays four
turns -- three tool calls, then the answer -- through the real agent loop, and:

  * every generated turn is in the training tokens exactly as the policy returned it;
  * the whole episode's text is what ``apply_chat_template`` renders for the same conversation;
  * a tool output holding the template's special-token strings stays ordinary text.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from transformers import AutoTokenizer

from megathunder.config import AgentLoopConfig, LocalSandboxConfig, VerifierConfig
from megathunder.models.tiny_hf import save_tiny_qwen2
from megathunder.rollout.agent_loop import AgentLoop
from megathunder.rollout.chat import ChatMLCodec, ToolCall
from megathunder.rollout.chat_template import TemplateCodec, TemplateError, make_codec
from megathunder.rollout.scripted import ScriptedPolicy
from megathunder.rollout.tasks.task import Task, TaskInstance, tool_call_text
from megathunder.rollout.tools import CALCULATOR, Tool
from megathunder.rollout.verifiers import VerifierPool

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
                   "<|python_tag|>"]
LLAMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] | trim %}"
    "{% set rest = messages[1:] %}{% else %}{% set system = '' %}{% set rest = messages %}{% endif %}"
    "{{ '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{% if tools %}{{ 'Environment: ipython\\n' }}{% endif %}{{ system }}"
    "{% if tools %}{{ '\\n\\nTo call a function, respond with JSON of the form {\"name\": function name, "
    "\"parameters\": dictionary of argument name and its value}. Functions:' }}"
    "{% for t in tools %}{{ '\\n' + (t | tojson) }}{% endfor %}{% endif %}{{ '<|eot_id|>' }}"
    "{% for m in rest %}"
    "{% if m['role'] == 'tool' %}{{ '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + (m['content'] | trim) }}"
    "{% else %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + (m['content'] | trim) }}{% endif %}"
    "{{ '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def chatml_tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(save_tiny_qwen2(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def llama3_tokenizer(tmp_path_factory):
    tok = AutoTokenizer.from_pretrained(save_tiny_qwen2(tmp_path_factory.mktemp("tiny")))
    tok.add_special_tokens({"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                            "additional_special_tokens": LLAMA3_SPECIALS})
    tok.chat_template = LLAMA3_TEMPLATE
    return tok


class EchoTask(Task):
    """Three calculator calls, then the answer; the third call's output holds special tokens."""

    name = "echo"
    system_prompt = "Use the tools."
    tools = (CALCULATOR, Tool("shout", "Print text.", {"text": "what to print"},
                              lambda sb, args: _shout(args), needs_sandbox=False))

    def __init__(self, call) -> None:
        self.call = call

    def instances(self, num: int, seed: int = 0) -> list[TaskInstance]:
        return [TaskInstance(instance_id=f"e{k}", prompt=f"What is {k} + 2 + 3?", answer=str(k + 5))
                for k in range(num)]

    async def verify(self, inst, episode, sandbox) -> float:
        return float(episode.final_text.strip() == inst.answer)

    def scripted_turns(self, inst: TaskInstance) -> list[str]:
        k = int(inst.instance_id[1:])
        return [self.call("calculator", expression=f"{k} + 2"), self.call("calculator", expression=f"{k + 2} + 3"),
                self.call("shout", text="<|eot_id|><|im_end|> done"), str(k + 5)]


async def _shout(args) -> str:
    return args["text"]


def _llama3_call(name: str, **arguments: str) -> str:
    return json.dumps({"name": name, "parameters": arguments})


def _run(codec, task, n=2):
    insts = task.instances(n)
    returned: dict[str, list[list[int]]] = {i.prompt: [] for i in insts}  # per episode, in turn order

    class Recording(ScriptedPolicy):
        async def generate(self, prompt_token_ids, params, *, session_id=None):
            out = await super().generate(prompt_token_ids, params, session_id=session_id)
            user = next(u for u in returned if u in codec.decode(prompt_token_ids))
            returned[user].append(list(out.token_ids))
            assert params.stop_token_ids == codec.stop_token_ids
            return out

    policy = Recording(codec, {i.prompt: task.scripted_turns(i) for i in insts})
    loop = AgentLoop(policy, codec, task, AgentLoopConfig(max_total_tokens=4096, max_new_tokens_per_turn=512),
                     LocalSandboxConfig(root_dir="/tmp/megathunder-test-sandboxes"), VerifierPool(VerifierConfig()),
                     emit=lambda e: None)
    return insts, asyncio.run(loop.run_batch(insts, 1)), returned


FAMILIES = {
    "chatml_hermes": ("chatml_tokenizer", "hermes", tool_call_text),
    "llama3_json": ("llama3_tokenizer", "llama3_json", _llama3_call),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_multi_turn_tokens_are_the_generated_ones_and_the_templates(family, request):
    fixture, parser, call = FAMILIES[family]
    tok = request.getfixturevalue(fixture)
    codec = TemplateCodec(tok, tool_parser=parser)
    task = EchoTask(call)
    insts, episodes, returned = _run(codec, task)
    for inst, ep in zip(insts, episodes, strict=True):
        outputs = iter(returned[inst.prompt])
        assert ep.stop_reason == "answered" and ep.reward.reward == 1.0, (ep.stop_reason, ep.final_text, ep.failure)
        assert len(ep.turns) == 4 and sum(len(t.tool_runs) for t in ep.turns) == 3
        assert [r.observation for t in ep.turns for r in t.tool_runs] == [
            str(int(inst.answer) - 3), inst.answer, "<|eot_id|><|im_end|> done"]
        for turn in ep.turns:  # byte for byte what the policy returned, and trained
            assert ep.token_ids[turn.start:turn.end] == next(outputs)
            assert all(ep.loss_mask[turn.start - 1:turn.end - 1])
        assert sum(ep.loss_mask) == sum(t.end - t.start for t in ep.turns)  # nothing else trained
        # The whole episode is the template's rendering of the same conversation.
        convo = task.messages(inst)
        for turn in ep.turns:
            convo.append({"role": "assistant", "content": codec.turn_text(ep.token_ids[turn.start:turn.end])})
            convo += [{"role": "tool", "content": r.observation} for r in turn.tool_runs]
        schemas = [{"type": "function", "function": s} for s in task.tool_schemas()]
        expected = tok.apply_chat_template(convo, tools=schemas, tokenize=False)
        assert codec.decode(ep.token_ids) + codec.glue_after_turn == expected  # the episode ends at the turn's end
        # The special-token strings a tool printed are ordinary text, not the template's tokens.
        specials = {codec.end_of_turn_id, *codec.stop_token_ids}
        shout = ep.turns[2]
        between = ep.token_ids[shout.end:ep.turns[3].start]
        assert sum(t in specials for t in between) == 1  # the template's own, closing the tool message


def test_the_chatml_template_gives_the_handwritten_codecs_tokens(chatml_tokenizer):
    """On the built-in tokenizer the template and the hand-written ChatML agree token for token."""
    template, handwritten = TemplateCodec(chatml_tokenizer), ChatMLCodec(chatml_tokenizer)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2 = <|im_end|>?"}]
    schemas = [CALCULATOR.schema()]
    assert template.prompt_ids(messages) == handwritten.prompt_ids(messages)
    # With tools the text is the same; the template's preamble is template text, so its
    # "<tool_call>" is the token Qwen's tokenizer makes of it (the hand-written codec spells it out).
    assert template.decode(template.prompt_ids(messages, schemas)) == handwritten.decode(
        handwritten.prompt_ids(messages, schemas))
    for outputs in (["4"], ["4", "five\n<tool_call>"]):
        assert template.tool_response_ids(outputs) == handwritten.tool_response_ids(outputs)
    assert template.end_of_turn_id == handwritten.end_of_turn_id


def test_llama3_calls_are_read_by_vllms_parser(llama3_tokenizer):
    codec = TemplateCodec(llama3_tokenizer, tool_parser="llama3_json")
    assert codec.parse_tool_calls(_llama3_call("calculator", expression="1 + 2")) == [
        ToolCall("calculator", {"expression": "1 + 2"})]
    assert codec.parse_tool_calls("The answer is 3.") == []
    assert codec.stop_token_ids[0] == llama3_tokenizer.convert_tokens_to_ids("<|eot_id|>")


def test_a_template_that_rewrites_earlier_turns_is_refused(chatml_tokenizer):
    """Qwen3-style: earlier assistant turns lose their reasoning when the conversation grows."""
    import copy

    tok = copy.deepcopy(chatml_tokenizer)
    tok.chat_template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
        "{% if m['role'] == 'assistant' and not loop.last %}{{ m['content'].split('</think>')[-1] }}"
        "{% else %}{{ m['content'] }}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    # The placeholders carry no </think>, so this one passes; one that drops old turns does not.
    TemplateCodec(tok)
    tok.chat_template = tok.chat_template.replace("m['content'].split('</think>')[-1]", "'(earlier turn)'")
    with pytest.raises(TemplateError, match="re-renders earlier turns"):
        TemplateCodec(tok)


def test_a_missing_template_and_an_unknown_parser_are_explained(llama3_tokenizer, chatml_tokenizer):
    import copy

    bare = copy.deepcopy(chatml_tokenizer)
    bare.chat_template = None
    with pytest.raises(TemplateError, match="agent.chat_template=chatml"):
        make_codec(bare, "model")
    assert isinstance(make_codec(llama3_tokenizer, "model", "llama3_json"), TemplateCodec)
    with pytest.raises(TemplateError, match="no tool parser"):
        make_codec(llama3_tokenizer, "model", "no_such_parser")
