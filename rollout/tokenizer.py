"""Chat tokenizers: the built-in byte-level one, and Hugging Face tokenizers loaded from a local
path (`load_tokenizer`).

Both implement `types.ChatTokenizer`: the agent loop encodes the prompt once and afterwards only
encodes what it appends (`encode_continuation`), so earlier turns are never re-tokenized.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from corral.rollout.hf_encoding import AddedTokenSplitEncoder, BoundedCache, render_key
from corral.rollout.types import ChatTokenizer

# ChatML, as Qwen and many others write it.
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
END_OF_TEXT = "<|endoftext|>"


class ByteChatTokenizer:
    """Ids 0-255 are the bytes of UTF-8 text; 256+ are the ChatML special tokens. No download, no
    merges: what the built-in reference server's policies speak.

    Text is rendered with the ChatML template: `<|im_start|>{role}\\n{content}<|im_end|>\\n` per
    message, then `<|im_start|>assistant\\n` as the generation prompt.
    """

    SPECIAL_TOKENS = (IM_START, IM_END, END_OF_TEXT)
    BYTE_COUNT = 256

    def __init__(self) -> None:
        self.special_ids = {token: self.BYTE_COUNT + i for i, token in enumerate(self.SPECIAL_TOKENS)}
        self._special_by_id = {i: token for token, i in self.special_ids.items()}
        self._special_pattern = re.compile("|".join(re.escape(t) for t in self.SPECIAL_TOKENS))

    @property
    def vocab_size(self) -> int:
        return self.BYTE_COUNT + len(self.SPECIAL_TOKENS)

    @property
    def end_of_turn_ids(self) -> tuple[int, ...]:
        return (self.special_ids[IM_END], self.special_ids[END_OF_TEXT])

    def encode(self, text: str) -> list[int]:
        """Ids of `text`; special-token strings in it become their ids."""
        ids: list[int] = []
        position = 0
        for match in self._special_pattern.finditer(text):
            ids += text[position : match.start()].encode()
            ids.append(self.special_ids[match.group()])
            position = match.end()
        ids += text[position:].encode()
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        parts: list[str] = []
        pending = bytearray()
        for token in ids:
            if 0 <= token < self.BYTE_COUNT:
                pending.append(token)
                continue
            parts.append(pending.decode(errors="replace"))
            pending.clear()
            parts.append(self._special_by_id.get(token, ""))
        parts.append(pending.decode(errors="replace"))
        return "".join(parts)

    def render(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool) -> str:
        text = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)
        return text + (f"{IM_START}assistant\n" if add_generation_prompt else "")

    def encode_prompt(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        return self.encode(self.render(messages, add_generation_prompt=True))

    def encode_continuation(
        self,
        history: Sequence[Mapping[str, str]],
        generated_ids: Sequence[int],
        new_messages: Sequence[Mapping[str, str]],
    ) -> list[int]:
        # The template is fixed, so the continuation is known exactly: close the assistant turn if
        # the generation did not (it hit max_new_tokens), then the new messages, then the prompt.
        closing = "" if generated_ids and generated_ids[-1] in self.end_of_turn_ids else IM_END
        return self.encode(closing + "\n" + self.render(new_messages, add_generation_prompt=True))


class HFChatTokenizer:
    """A Hugging Face tokenizer with its chat template, loaded from a local directory (nothing is
    downloaded), for real models (Qwen, Llama, ...).

    The prompt is the template's rendering, tokenized once. After that only the text the template
    would append is tokenized, alone (`encode_continuation`): the generated ids stay exactly as the
    model produced them, even where tokenizing the whole conversation again would merge or split
    them differently. Needs the `corral[hf]` extra.

    `template_kwargs` go to every `apply_chat_template` call (e.g. {"enable_thinking": False}).
    `tools` (OpenAI function specs, for the LLM gateway) go to the template as its `tools`.

    The LLM gateway renders each call's whole conversation, and a call's history is the previous
    call's conversation: renderings are kept in a bounded cache (not for templates that print the
    date, `strftime_now`), and text is tokenized piece by piece between added tokens, each piece
    once (`hf_encoding`), where the tokenizer allows it; the ids are the same either way.
    """

    RENDER_CACHE_CHARS = 32_000_000  # keys and renderings, in characters

    # Placeholder contents for the conversation the fixed continuation is computed on: text no
    # template changes and no real message contains.
    _PLACEHOLDER_USER = "\u2063corral-placeholder-user\u2063"
    _PLACEHOLDER_ASSISTANT = "\u2063corral-placeholder-assistant\u2063"

    def __init__(self, path: str | os.PathLike[str] | Any, *, template_kwargs: Mapping[str, Any] | None = None) -> None:
        if isinstance(path, (str, os.PathLike)):
            transformers = _import_transformers()
            self.path = str(path)
            self._tokenizer = transformers.AutoTokenizer.from_pretrained(self.path, local_files_only=True)
        else:  # a tokenizer object the caller already holds (e.g. a trainer's)
            self._tokenizer = path
            self.path = str(getattr(path, "name_or_path", "") or type(path).__name__)
        if not getattr(self._tokenizer, "chat_template", None):
            raise ValueError(f"the tokenizer in {self.path} has no chat template")
        self._template_kwargs = dict(template_kwargs or {})
        vocab = self._tokenizer.get_vocab()
        ids = [self._tokenizer.eos_token_id] if self._tokenizer.eos_token_id is not None else []
        if IM_END in vocab:
            ids.append(vocab[IM_END])
        if not ids:
            raise ValueError(f"the tokenizer in {self.path} has no EOS token and no {IM_END}: nothing ends a turn")
        self._end_of_turn_ids = tuple(dict.fromkeys(ids))
        self._end_of_turn_texts = tuple(self.decode([i]) for i in self._end_of_turn_ids)
        self._renders: BoundedCache[str] | None = None
        if "strftime_now" not in str(self._tokenizer.chat_template):
            self._renders = BoundedCache(self.RENDER_CACHE_CHARS, lambda key, text: len(str(key)) + len(text))
        self._cached_template = self._tokenizer.chat_template
        self._split_encoder = AddedTokenSplitEncoder.for_tokenizer(self._tokenizer)

    @property
    def end_of_turn_ids(self) -> tuple[int, ...]:
        return self._end_of_turn_ids

    def encode(self, text: str) -> list[int]:
        """Ids of `text` alone: no BOS or other added tokens; special-token strings become their ids."""
        if self._split_encoder is not None:
            if self._split_encoder.still_valid():
                return self._split_encoder.encode(text)
            self._split_encoder = AddedTokenSplitEncoder.for_tokenizer(self._tokenizer)
            if self._split_encoder is not None:
                return self._split_encoder.encode(text)
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def render(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool, tools: list[Any] | None = None
    ) -> str:
        if self._tokenizer.chat_template is not self._cached_template and self._renders is not None:
            self._renders = BoundedCache(self.RENDER_CACHE_CHARS, self._renders.size_of)  # the template was replaced
            self._cached_template = self._tokenizer.chat_template
        key = render_key(messages, tools, add_generation_prompt) if self._renders is not None else None
        if key is not None and self._renders is not None:
            cached = self._renders.get(key)
            if cached is not None:
                return cached
        extra = {**self._template_kwargs, **({"tools": tools} if tools else {})}
        text: str = self._tokenizer.apply_chat_template(
            [dict(m) for m in messages],
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **extra,
        )
        if key is not None and self._renders is not None:
            self._renders.put(key, text)
        return text

    def encode_prompt(self, messages: Sequence[Mapping[str, Any]], tools: list[Any] | None = None) -> list[int]:
        return self.encode(self.render(messages, add_generation_prompt=True, tools=tools))

    def encode_continuation(
        self,
        history: Sequence[Mapping[str, Any]],
        generated_ids: Sequence[int],
        new_messages: Sequence[Mapping[str, Any]],
        tools: list[Any] | None = None,
    ) -> list[int]:
        """`history` is the conversation before the assistant turn that `generated_ids` is."""
        generated = list(generated_ids)
        ends_turn = bool(generated) and generated[-1] in self._end_of_turn_ids
        content_ids = generated
        while content_ids and content_ids[-1] in self._end_of_turn_ids:
            content_ids = content_ids[:-1]
        assistant = {"role": "assistant", "content": self.decode(content_ids)}
        # What the sequence reads as now, and what the template renders once the turn is in the
        # history: when the first is a prefix of the second, the rest is exactly what to append.
        before = self.render(history, add_generation_prompt=True, tools=tools) + self.decode(generated)
        after = self.render([*history, assistant, *new_messages], add_generation_prompt=True, tools=tools)
        if after.startswith(before):
            return self.encode(after[len(before) :])
        # The template rewrites history (e.g. drops <think> blocks of earlier turns), so the two
        # renderings disagree: append what it puts after an assistant turn in general.
        return self.encode(self._continuation_after_turn(new_messages, ends_turn, tools))

    def _continuation_after_turn(
        self, new_messages: Sequence[Mapping[str, Any]], ends_turn: bool, tools: list[Any] | None = None
    ) -> str:
        """The text the template puts after an assistant message's content when `new_messages`
        follow it (its closing, the new messages, the generation prompt), computed on a placeholder
        conversation. When the generation already ended its turn with an end-of-turn token, the
        closing's leading end-of-turn token is not repeated."""
        base = [
            {"role": "user", "content": self._PLACEHOLDER_USER},
            {"role": "assistant", "content": self._PLACEHOLDER_ASSISTANT},
        ]
        text = self.render([*base, *new_messages], add_generation_prompt=True, tools=tools)
        at = text.rfind(self._PLACEHOLDER_ASSISTANT)
        if at < 0:
            raise ValueError(
                f"the chat template of {self.path} does not render assistant messages verbatim; "
                "cannot tell what follows a turn"
            )
        delta = text[at + len(self._PLACEHOLDER_ASSISTANT) :]
        if ends_turn:
            for end_text in self._end_of_turn_texts:
                if delta.startswith(end_text):
                    return delta[len(end_text) :]
        return delta


def load_tokenizer(spec: str) -> ChatTokenizer:
    """The chat tokenizer a task or config names: "byte" (or "builtin:byte") for ByteChatTokenizer,
    else a local directory holding a Hugging Face tokenizer with a chat template."""
    if spec in ("byte", "builtin:byte"):
        return ByteChatTokenizer()
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise ValueError(
            f"tokenizer {spec!r}: neither 'byte' nor a local directory (Hugging Face tokenizers are "
            "loaded from a local path only; nothing is downloaded)"
        )
    return HFChatTokenizer(path)


def chat_tokenizer(source: Any) -> ChatTokenizer:
    """A ChatTokenizer from what a caller has: one already (returned as is), a spec for
    `load_tokenizer` ("byte" or a local directory), or a Hugging Face tokenizer object (wrapped)."""
    if hasattr(source, "encode_continuation"):
        return source
    if isinstance(source, (str, os.PathLike)):
        return load_tokenizer(str(source))
    return HFChatTokenizer(source)


def _import_transformers() -> Any:
    try:
        import transformers
    except ImportError as error:
        raise ImportError(
            "Hugging Face tokenizers need the transformers package: install the corral[hf] extra "
            "(pip install 'corral[hf]')"
        ) from error
    return transformers
