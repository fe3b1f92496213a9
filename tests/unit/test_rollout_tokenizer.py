"""Chat tokenizers: the byte-level one, and Hugging Face ones loaded from a local directory.

The Hugging Face tokenizer is a real byte-level BPE model trained here, offline, on a small corpus,
saved with a ChatML chat template the way Qwen writes it (tool results as <tool_response> blocks in
a user turn). `make_hf_tokenizer_dir` is shared with tests/integration/test_agent_loop.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from corral.rollout.tokenizer import ByteChatTokenizer, HFChatTokenizer, load_tokenizer

# Qwen2.5's template reduced to what the rollout uses: consecutive tool messages share one user
# turn, each in its own <tool_response> block.
QWEN_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Like Qwen3's: the reasoning of assistant turns is dropped from the history, so rendering the
# conversation again does not reproduce what the model generated.
THINK_STRIPPING_TEMPLATE = QWEN_TEMPLATE.replace(
    "{%- else %}",
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + message.content.split('</think>')[-1].lstrip('\\n') + '<|im_end|>\\n' }}"
    "{%- else %}",
    1,
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_CORPUS = [
    "Let me look at the repository first. I will list the files and then read the tests.",
    '<tool_call>{"name": "bash", "arguments": {"command": "ls -la && cat README.md"}}</tool_call>',
    '<tool_call>{"name": "submit", "arguments": {}}</tool_call>',
    "<tool_response>\ntotal 12\ndrwxr-xr-x 2 root root 4096 main.py tests\n</tool_response>",
    "def main():\n    print('hello world')\n    return 0\n\nif __name__ == '__main__':\n    main()\n",
    "<think>\nThe test fails because the function returns None.\n</think>\n\nI will fix it.",
    'Traceback (most recent call last):\n  File "main.py", line 3, in <module>\nZeroDivisionError',
]


def make_hf_tokenizer_dir(
    path: Path, template: str = QWEN_TEMPLATE, *, eos_token: str = "<|endoftext|>", with_template: bool = True
) -> Path:
    """Trains a byte-level BPE tokenizer on a small corpus and saves it, with `template`, as a
    Hugging Face tokenizer directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=800,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_CORPUS * 30, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=eos_token,
        pad_token="<|endoftext|>",
        chat_template=template if with_template else None,
    )
    path.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> Path:
    return make_hf_tokenizer_dir(tmp_path_factory.mktemp("qwen-like"))


@pytest.fixture(scope="module")
def hf(qwen_dir) -> HFChatTokenizer:
    tokenizer = load_tokenizer(str(qwen_dir))
    assert isinstance(tokenizer, HFChatTokenizer)
    return tokenizer


CHAT = [
    {"role": "system", "content": "You are a careful agent."},
    {"role": "user", "content": "Fix the failing test in main.py."},
]
TOOL = [{"role": "tool", "content": "total 12\nmain.py tests"}]


# --- ByteChatTokenizer -----------------------------------------------------------------------------


def test_byte_tokenizer_round_trips_text_and_special_tokens():
    tokenizer = ByteChatTokenizer()
    text = "<|im_start|>user\nhéllo 😀 \x00\x1b[31m<|im_end|>\n<|endoftext|>"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert ids.count(tokenizer.special_ids["<|im_end|>"]) == 1
    assert all(0 <= i < tokenizer.vocab_size for i in ids)
    # A byte sequence cut inside a character decodes with a replacement character, not an error.
    assert tokenizer.decode(list("😀".encode())[:2]) == "\ufffd"


def test_byte_tokenizer_continuation_reproduces_the_template():
    tokenizer = ByteChatTokenizer()
    prompt = tokenizer.encode_prompt(CHAT)
    assert tokenizer.decode(prompt) == tokenizer.render(CHAT, add_generation_prompt=True)
    end = tokenizer.special_ids["<|im_end|>"]
    for generated, closed in ((tokenizer.encode("ls") + [end], True), (tokenizer.encode("ls -"), False)):
        continuation = tokenizer.encode_continuation(CHAT, generated, TOOL)
        reply = {"role": "assistant", "content": "ls" if closed else "ls -"}
        assert tokenizer.decode(prompt + generated + continuation) == tokenizer.render(
            [*CHAT, reply, *TOOL], add_generation_prompt=True
        )


# --- load_tokenizer ----------------------------------------------------------------------------------


def test_load_tokenizer_specs(tmp_path):
    assert isinstance(load_tokenizer("byte"), ByteChatTokenizer)
    assert isinstance(load_tokenizer("builtin:byte"), ByteChatTokenizer)
    with pytest.raises(ValueError, match="neither 'byte' nor a local directory"):
        load_tokenizer(str(tmp_path / "missing"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="local directory"):
        load_tokenizer(str(tmp_path / "file"))
    with pytest.raises(ValueError, match="local directory"):
        load_tokenizer("Qwen/Qwen2.5-7B-Instruct")  # a hub name: nothing is downloaded


def test_missing_transformers_names_the_extra(monkeypatch, qwen_dir):
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    with pytest.raises(ImportError, match=r"corral\[hf\]"):
        HFChatTokenizer(qwen_dir)


def test_tokenizer_without_chat_template_is_refused(tmp_path):
    path = make_hf_tokenizer_dir(tmp_path / "plain", with_template=False)
    with pytest.raises(ValueError, match="no chat template"):
        HFChatTokenizer(path)


# --- HFChatTokenizer ---------------------------------------------------------------------------------


def test_end_of_turn_ids_are_eos_and_im_end(hf, tmp_path):
    vocab = hf._tokenizer.get_vocab()
    assert hf.end_of_turn_ids == (vocab["<|endoftext|>"], vocab["<|im_end|>"])
    # When EOS is <|im_end|> itself, it is listed once.
    same = HFChatTokenizer(make_hf_tokenizer_dir(tmp_path / "im-end-eos", eos_token="<|im_end|>"))
    assert same.end_of_turn_ids == (vocab["<|im_end|>"],)


def test_prompt_is_the_template_rendering_without_added_tokens(hf):
    rendered = hf._tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>assistant\n")
    ids = hf.encode_prompt(CHAT)
    assert ids == hf._tokenizer.encode(rendered, add_special_tokens=False)
    assert hf.decode(ids) == rendered
    assert ids[0] == hf._tokenizer.get_vocab()["<|im_start|>"]


def test_continuation_is_the_template_delta_tokenized_alone(hf):
    im_end = hf._tokenizer.get_vocab()["<|im_end|>"]
    # Character by character: not how the tokenizer would split the text, so re-tokenizing would change it.
    text = "Let me look at the files."
    generated = [i for char in text for i in hf.encode(char)] + [im_end]
    assert generated[:-1] != hf.encode(text)
    tools = [{"role": "tool", "content": "first"}, {"role": "tool", "content": "second"}]
    continuation = hf.encode_continuation(CHAT, generated, tools)
    expected = (
        "\n<|im_start|>user\n<tool_response>\nfirst\n</tool_response>\n<tool_response>\nsecond\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert hf.decode(continuation) == expected
    assert continuation == hf.encode(expected)
    # Cut by max_new_tokens: the continuation closes the turn first.
    cut = generated[:7]
    continuation = hf.encode_continuation(CHAT, cut, tools)
    assert hf.decode(continuation) == "<|im_end|>" + expected
    full = hf.render([*CHAT, {"role": "assistant", "content": hf.decode(cut)}, *tools], add_generation_prompt=True)
    assert hf.decode(hf.encode_prompt(CHAT) + cut + continuation) == full


def test_continuation_falls_back_when_the_template_rewrites_history(tmp_path):
    hf = HFChatTokenizer(make_hf_tokenizer_dir(tmp_path / "think", THINK_STRIPPING_TEMPLATE))
    vocab = hf._tokenizer.get_vocab()
    reply = "<think>\nThe test fails.\n</think>\n\nI will fix it."
    history_render = hf.render([*CHAT, {"role": "assistant", "content": reply}, *TOOL], add_generation_prompt=True)
    assert "<think>" not in history_render  # the template really drops it
    expected = (
        "\n<|im_start|>user\n<tool_response>\ntotal 12\nmain.py tests\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ended = hf.encode(reply) + [vocab["<|im_end|>"]]
    assert hf.decode(hf.encode_continuation(CHAT, ended, TOOL)) == expected
    # Cut by length: the end of turn is written first.
    assert hf.decode(hf.encode_continuation(CHAT, hf.encode(reply)[:-2], TOOL)) == "<|im_end|>" + expected
    # Ended by EOS (<|endoftext|>) rather than <|im_end|>: the turn counts as closed.
    eos = hf.encode(reply) + [vocab["<|endoftext|>"]]
    assert hf.decode(hf.encode_continuation(CHAT, eos, TOOL)) == expected


def test_template_kwargs_reach_the_template(tmp_path):
    template = QWEN_TEMPLATE.replace(
        "'<|im_start|>assistant\\n' }}{%- endif %}", "'<|im_start|>assistant\\n' + (prefill or '') }}{%- endif %}"
    )
    path = make_hf_tokenizer_dir(tmp_path / "kwargs", template)
    assert HFChatTokenizer(path).decode(HFChatTokenizer(path).encode_prompt(CHAT)).endswith("assistant\n")
    prefilled = HFChatTokenizer(path, template_kwargs={"prefill": "<think>\n"})
    assert prefilled.decode(prefilled.encode_prompt(CHAT)).endswith("assistant\n<think>\n")
