"""The Hugging Face tokenizer's shortcuts (rollout/hf_encoding.py) give exactly the ids and text of
the plain path: piece-wise encoding against a full encode of many random conversations, the
render cache against the template rendered afresh."""

from __future__ import annotations

import random

import pytest

from corral.rollout.hf_encoding import AddedTokenSplitEncoder, BoundedCache
from corral.rollout.tokenizer import HFChatTokenizer
from tests.unit.test_gateway_render import tiny_qwen2  # noqa: F401 - a fixture
from tests.unit.test_rollout_tokenizer import _CORPUS, SPECIAL_TOKENS, make_hf_tokenizer_dir

# Text that stresses the cuts: special tokens and pieces of them, spaces and newlines on both
# sides, a combining accent after a token (NFC joins it with a preceding "e" only within a piece),
# digits, other scripts, and the extra added tokens of `_extra_tokens_tokenizer`.
_FRAGMENTS = [
    *SPECIAL_TOKENS,
    "<|im_",
    "end|>",
    "<|",
    "|>",
    " ",
    "  ",
    "\n",
    "\n\n",
    "e",
    "\u0301",
    "e\u0301",
    "12345",
    "héllo wörld",
    "日本語のテキスト",
    "<tool_call>",
    "</tool_call>",
    "<tool_call>!",
    '{"name": "bash"}',
    *_CORPUS,
]


def _random_text(rng: random.Random) -> str:
    return "".join(rng.choice(_FRAGMENTS) for _ in range(rng.randint(0, 12)))


def _random_conversation(rng: random.Random, turns: int) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": _random_text(rng)}]
    for _ in range(turns):
        messages.append({"role": "user", "content": _random_text(rng)})
        messages.append({"role": "assistant", "content": _random_text(rng)})
    return messages


def _assert_piecewise_equals_full(tokenizer: HFChatTokenizer, seed: int) -> None:
    """Renders growing random conversations (as the gateway does, call after call, so that the
    piece cache is hit) and random raw text; every encode equals the tokenizer's own."""
    rng = random.Random(seed)
    raw = tokenizer._tokenizer
    for _ in range(40):
        conversation = _random_conversation(rng, rng.randint(1, 6))
        for end in range(1, len(conversation) + 1):
            text = tokenizer.render(conversation[:end], add_generation_prompt=end % 2 == 1)
            assert tokenizer.encode(text) == raw.encode(text, add_special_tokens=False), text
        text = _random_text(rng)
        assert tokenizer.encode(text) == raw.encode(text, add_special_tokens=False), text


def test_the_tiny_models_tokenizer_encodes_piecewise_exactly(tiny_qwen2):  # noqa: F811 - the fixture
    assert tiny_qwen2._split_encoder is not None
    _assert_piecewise_equals_full(tiny_qwen2, seed=16)


def _trained_tokenizer(tmp_path, *, added: list[object] | None = None, metaspace: bool = False) -> HFChatTokenizer:
    """The qwen-like test tokenizer with an NFC normalizer, `added` tokens (as given: their flags
    are what is tested) and, with `metaspace`, a pre-tokenizer that treats the input's start apart."""
    from tokenizers import decoders, normalizers, pre_tokenizers
    from transformers import AutoTokenizer

    fast = AutoTokenizer.from_pretrained(str(make_hf_tokenizer_dir(tmp_path)), local_files_only=True)
    backend = fast.backend_tokenizer
    backend.normalizer = normalizers.NFC()
    if metaspace:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        backend.decoder = decoders.Metaspace(prepend_scheme="first")
    if added:
        backend.add_tokens(added)
    return HFChatTokenizer(fast)


def test_added_tokens_that_overlap_are_cut_leftmost_longest(tmp_path):
    pytest.importorskip("transformers")
    from tokenizers import AddedToken

    tokens = [
        AddedToken("<tool_call>", normalized=False),
        AddedToken("</tool_call>", normalized=False),
        AddedToken("<tool_call>!", normalized=False),
    ]
    tokenizer = _trained_tokenizer(tmp_path, added=tokens)
    assert tokenizer._split_encoder is not None
    _assert_piecewise_equals_full(tokenizer, seed=7)


@pytest.mark.parametrize(
    "variant",
    ["lstrip", "rstrip", "normalized", "single_word", "metaspace"],
)
def test_tokenizers_whose_cuts_are_not_clean_are_encoded_whole(tmp_path, variant):
    pytest.importorskip("transformers")
    from tokenizers import AddedToken

    if variant == "metaspace":
        tokenizer = _trained_tokenizer(tmp_path, metaspace=True)
    else:
        flags = {"normalized": False, variant: True}
        tokenizer = _trained_tokenizer(tmp_path, added=[AddedToken("<tool_call>", **flags)])
    assert tokenizer._split_encoder is None
    _assert_piecewise_equals_full(tokenizer, seed=3)


def test_tokens_added_later_are_cut_too(tmp_path):
    pytest.importorskip("transformers")
    tokenizer = _trained_tokenizer(tmp_path)
    text = "call <tool_call>ls</tool_call> now"
    before = tokenizer.encode(text)
    tokenizer._tokenizer.add_tokens(["<tool_call>", "</tool_call>"])
    assert tokenizer.encode(text) == tokenizer._tokenizer.encode(text, add_special_tokens=False) != before


def test_renderings_come_from_the_cache_only_for_the_same_input(tiny_qwen2):  # noqa: F811 - the fixture
    raw = tiny_qwen2._tokenizer
    messages = [{"role": "user", "content": "1"}, {"role": "assistant", "content": "x"}]
    for add_generation_prompt in (True, False, True):
        assert tiny_qwen2.render(messages, add_generation_prompt) == raw.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    # A list and a tuple, or a string and a number, can print differently: never the same entry.
    listed = [{"role": "user", "content": "hi", "extra": [1, 2]}]
    tupled = [{"role": "user", "content": "hi", "extra": (1, 2)}]
    assert tiny_qwen2.render(listed, True) == raw.apply_chat_template(
        listed, tokenize=False, add_generation_prompt=True
    )
    assert tiny_qwen2.render(tupled, True) == raw.apply_chat_template(
        tupled, tokenize=False, add_generation_prompt=True
    )
    tools = [{"type": "function", "function": {"name": "bash", "parameters": {}}}]
    assert tiny_qwen2.render(messages, True, tools=tools) == raw.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True
    )


def test_a_replaced_template_is_rendered_afresh(tmp_path):
    pytest.importorskip("transformers")
    tokenizer = _trained_tokenizer(tmp_path)
    messages = [{"role": "user", "content": "hi"}]
    first = tokenizer.render(messages, True)
    tokenizer._tokenizer.chat_template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    assert tokenizer.render(messages, True) == "[hi]" != first


def test_the_bounded_cache_evicts_the_least_recently_used():
    cache: BoundedCache[str] = BoundedCache(10, lambda key, value: len(value))
    cache.put("a", "xxxx")
    cache.put("b", "xxxx")
    assert cache.get("a") == "xxxx"
    cache.put("c", "xxxx")  # 12 > 10: "b", used least recently, goes
    assert (cache.get("b"), cache.get("a"), cache.get("c")) == (None, "xxxx", "xxxx")
    cache.put("d", "x" * 11)  # larger than the whole cache: not kept
    assert cache.get("d") is None and len(cache) == 2


def test_split_encoder_refuses_a_slow_tokenizer():
    class Slow:
        pass

    assert AddedTokenSplitEncoder.for_tokenizer(Slow()) is None
