"""Rendering OpenAI requests for the gateway: normalization (what counts as the same message),
the byte template's deterministic tools block and tool-call text, and a Hugging Face chat template
that takes tools and tool calls itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from corral.rollout.gateway import HistoryPolicy
from corral.rollout.gateway.errors import RequestError
from corral.rollout.gateway.render import ChatRenderer, Conversation, normalize_messages, normalize_tools, same_reply
from corral.rollout.gateway.session import CallOptions
from corral.rollout.tokenizer import HFChatTokenizer
from corral.rollout.tool_calls import ToolCallFormat, strip_tool_calls
from tests.torch_needed import TORCH_MISSING
from tests.unit.gateway_support import BASH_TOOL, TOK, ScriptedLLM, assert_token_exact, make_session, settings

REPO = Path(__file__).resolve().parents[2]


def test_normalization_makes_equivalent_spellings_equal():
    spaced = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}
        ],
    }
    compact = {
        "role": "assistant",
        "content": [{"type": "text", "text": ""}],
        "tool_calls": [{"id": "call_1", "function": {"name": "bash", "arguments": {"command": "ls"}}}],
    }
    assert normalize_messages([spaced]) == normalize_messages([compact])
    (message,) = normalize_messages([spaced])
    assert message == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": "bash", "arguments": {"command": "ls"}}, "id": "call_1"}
        ],
    }
    assert normalize_messages([{"role": "developer", "content": [{"type": "text", "text": "a"}, "b"]}]) == (
        {"role": "system", "content": "ab"},
    )
    tool = normalize_messages([{"role": "tool", "tool_call_id": "call_1", "content": "out"}])
    assert tool == ({"role": "tool", "content": "out", "tool_call_id": "call_1"},)


def test_a_reply_sent_back_matches_only_with_the_tool_call_ids_it_was_given():
    call = {"type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}
    (recorded,) = normalize_messages([{"role": "assistant", "content": "", "tool_calls": [{**call, "id": "call_a"}]}])
    (same,) = normalize_messages([{"role": "assistant", "content": "", "tool_calls": [{**call, "id": "call_a"}]}])
    (other,) = normalize_messages([{"role": "assistant", "content": "", "tool_calls": [{**call, "id": "call_b"}]}])
    (no_id,) = normalize_messages([{"role": "assistant", "content": "", "tool_calls": [call]}])
    assert same_reply(recorded, same)
    assert not same_reply(recorded, other)
    assert same_reply(recorded, no_id)  # a harness that drops ids still extends the sample
    with pytest.raises(RequestError, match="id must be a non-empty string"):
        normalize_messages([{"role": "assistant", "content": "", "tool_calls": [{**call, "id": 7}]}])


def test_a_reply_matches_up_to_surrounding_whitespace_but_not_other_calls():
    (recorded,) = normalize_messages([{"role": "assistant", "content": "Let me see.\n"}])
    assert same_reply(recorded, {"role": "assistant", "content": "Let me see."})
    assert not same_reply(recorded, {"role": "assistant", "content": "Let me look."})
    assert not same_reply(recorded, {"role": "user", "content": "Let me see."})


@pytest.mark.parametrize(
    "messages",
    [
        [],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}],
        [{"role": "assistant", "tool_calls": {"function": {}}}],
        [{"role": "tool", "tool_call_id": 3, "content": "x"}],
    ],
)
def test_malformed_messages_are_request_errors(messages):
    with pytest.raises(RequestError):
        normalize_messages(messages)


def test_byte_rendering_writes_tools_and_tool_calls_deterministically():
    renderer = ChatRenderer(TOK, ToolCallFormat.HERMES)
    reordered_tool = json.loads(json.dumps(BASH_TOOL), object_pairs_hook=lambda pairs: dict(reversed(pairs)))
    messages = normalize_messages(
        [
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": "Sure.",
                "tool_calls": [{"function": {"name": "bash", "arguments": '{"command":"ls"}'}}],
            },
        ]
    )
    first = renderer.encode_prompt(Conversation(messages, normalize_tools([BASH_TOOL])))
    second = renderer.encode_prompt(Conversation(messages, normalize_tools([reordered_tool])))
    assert first == second
    text = TOK.decode(first)
    assert text.startswith("<|im_start|>system\n# Tools\n")
    assert "<tools>\n" + json.dumps(BASH_TOOL, sort_keys=True) + "\n</tools>" in text
    assert 'Sure.\n<tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call><|im_end|>' in text
    # An existing system message gets the block appended.
    with_system = Conversation(
        (*normalize_messages([{"role": "system", "content": "Be brief."}]), *messages), normalize_tools([BASH_TOOL])
    )
    assert TOK.decode(renderer.encode_prompt(with_system)).startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")


def test_fenced_bash_sessions_write_calls_as_bash_blocks():
    renderer = ChatRenderer(TOK, ToolCallFormat.FENCED_BASH)
    messages = normalize_messages(
        [
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"function": {"name": "bash", "arguments": {"command": "ls"}}}],
            }
        ]
    )
    assert "```bash\nls\n```" in TOK.decode(renderer.encode_prompt(Conversation(messages)))
    other = normalize_messages([{"role": "assistant", "tool_calls": [{"function": {"name": "edit", "arguments": {}}}]}])
    with pytest.raises(RequestError, match="cannot be written"):
        renderer.encode_prompt(Conversation(other))


def test_strip_tool_calls_keeps_the_prose():
    text = 'First.\n<tool_call>{"name": "a", "arguments": {}}</tool_call>\nThen.\n<tool_call>{"name": "b"}</tool_call>'
    assert strip_tool_calls(text, ToolCallFormat.HERMES) == "First.\n\nThen."
    assert strip_tool_calls("Run it:\n```bash\nls\n```\nSUBMIT\n", ToolCallFormat.FENCED_BASH) == "Run it:"


# A Qwen2.5-like template: tools listed in the system turn, assistant tool calls written from
# their structured form, tool results in <tool_response> blocks of a user turn.
TOOLS_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n<tools>' }}{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' %}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' + message.content }}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- if message.content or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>{\"name\": \"' + call.function.name + '\", \"arguments\": ' + (call.function.arguments | tojson) + '}</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def hf_tools(tmp_path_factory) -> HFChatTokenizer:
    pytest.importorskip("transformers")
    from tests.unit.test_rollout_tokenizer import make_hf_tokenizer_dir

    return HFChatTokenizer(make_hf_tokenizer_dir(tmp_path_factory.mktemp("hf-tools"), TOOLS_TEMPLATE))


async def test_hugging_face_template_gets_tools_and_tool_calls_and_stays_token_exact(hf_tools):
    im_end = hf_tools.encode("<|im_end|>")
    assert len(im_end) == 1
    call = '<tool_call>{"name": "bash", "arguments": {"command": "ls -la"}}</tool_call>'
    llm = ScriptedLLM([call, "Done: main.py tests"], tokenizer=hf_tools, end_id=im_end[0])
    session = make_session(llm, settings(HistoryPolicy.FAIL), tokenizer=hf_tools)
    messages = [{"role": "system", "content": "You are a careful agent."}, {"role": "user", "content": "Fix main.py."}]
    tools = normalize_tools([BASH_TOOL])
    options = CallOptions(parse_tool_calls=True)
    result, reply = await session.chat(Conversation(normalize_messages(messages), tools), options)
    assert reply["tool_calls"][0]["function"] == {"name": "bash", "arguments": {"command": "ls -la"}}
    prompt_text = hf_tools.decode(result.prompt_ids)
    assert "# Tools\n<tools>\n" in prompt_text and '"name": "bash"' in prompt_text
    call_id = reply["tool_calls"][0]["id"]
    messages += [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": call_id, "function": {"name": "bash", "arguments": '{"command":"ls -la"}'}}],
        },
        {"role": "tool", "tool_call_id": call_id, "content": "main.py tests"},
    ]
    await session.chat(Conversation(normalize_messages(messages), tools), options)
    outcome = session.close()
    assert_token_exact(outcome.samples[0], llm.calls)
    # The template writes the call from its structured form exactly as the model wrote it.
    assert (outcome.counters.prefix_hits, outcome.counters.splices) == (1, 0)


@pytest.fixture(scope="module")
def tiny_qwen2() -> HFChatTokenizer:
    """The tokenizer of the tiny model the real-engine tests serve (built offline with torch, cached)."""
    pytest.importorskip("transformers")
    pytest.importorskip("torch", reason=TORCH_MISSING)
    model_dir = Path(os.environ.get("CORRAL_TEST_MODEL_CACHE", Path.home() / ".cache" / "corral" / "tiny-qwen2"))
    subprocess.run(
        [sys.executable, str(REPO / "scripts" / "build_tiny_model.py"), str(model_dir)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return HFChatTokenizer(model_dir)


@pytest.mark.parametrize("with_tools", [False, True])
async def test_the_tiny_models_tokenizer_is_token_exact_over_four_calls(tiny_qwen2, with_tools):
    # Its ChatML template renders content only: with tools, the replies' tool calls are not in a
    # re-rendering (their markup is not in the returned content), so each later call is a splice
    # of the recorded ids; without tools the re-rendering is the recorded ids exactly.
    replies = [
        f'Step {i}.\n<tool_call>{{"name": "bash", "arguments": {{"command": "ls {i}"}}}}</tool_call>' for i in range(4)
    ]
    end_id = tiny_qwen2.encode("<|im_end|>")[0]
    llm = ScriptedLLM(replies, tokenizer=tiny_qwen2, end_id=end_id)
    session = make_session(llm, settings(HistoryPolicy.FAIL), tokenizer=tiny_qwen2)
    tools = normalize_tools([BASH_TOOL] if with_tools else None)
    messages: list[dict] = [{"role": "user", "content": "Fix calc.py so that the tests pass."}]
    for i in range(4):
        _, reply = await session.chat(
            Conversation(normalize_messages(messages), tools), CallOptions(parse_tool_calls=with_tools)
        )
        messages.append({**reply, "tool_calls": [{"id": f"c{i}", **call} for call in reply.get("tool_calls", [])]})
        messages.append({"role": "tool", "tool_call_id": f"c{i}", "content": f"Ran {i} tests\nOK"})
    outcome = session.close()
    assert_token_exact(outcome.samples[0], llm.calls)
    counters = outcome.counters
    assert (counters.splices, counters.prefix_hits) == ((3, 0) if with_tools else (0, 3))
