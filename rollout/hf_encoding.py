"""What makes a Hugging Face chat tokenizer cheap to call once per LLM call of a growing
conversation, without changing a single id: a bounded cache of chat-template renderings, and an
encoder that tokenizes only the text between added tokens it has not seen before.

Both rest on the conversation being re-rendered in full on every call (the gateway compares the
full rendering with the recorded ids): the rendering of the previous call comes back as the
history of the next one, and all but its last few messages render to text already tokenized.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

_V = TypeVar("_V")

# Pre-tokenizers and normalizers that treat the start of the whole input differently from the
# start of a piece between added tokens (Metaspace's prepend_scheme "first" prepends "▁" only at
# offset 0): with them, a piece tokenized alone may differ from the same piece inside the text.
_POSITION_DEPENDENT = ("Metaspace", "prepend_scheme")


class BoundedCache(Generic[_V]):
    """Least recently used entries, evicted once their total size (the caller's measure, e.g.
    characters) passes `capacity`. Safe to share between threads (a trainer's tokenizer may be)."""

    def __init__(self, capacity: int, size_of: Callable[[Hashable, _V], int]) -> None:
        self.capacity = capacity
        self.size_of = size_of
        self._entries: OrderedDict[Hashable, _V] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> _V | None:
        with self._lock:
            value = self._entries.get(key)
            if value is not None:
                self._entries.move_to_end(key)
            return value

    def put(self, key: Hashable, value: _V) -> None:
        size = self.size_of(key, value)
        if size > self.capacity:
            return
        with self._lock:
            previous = self._entries.pop(key, None)
            if previous is not None:
                self._size -= self.size_of(key, previous)
            self._entries[key] = value
            self._size += size
            while self._size > self.capacity:
                old_key, old_value = self._entries.popitem(last=False)
                self._size -= self.size_of(old_key, old_value)

    def __len__(self) -> int:
        return len(self._entries)


def render_key(messages: Any, tools: Any, add_generation_prompt: bool) -> str | None:
    """A key that is equal only for inputs a template renders alike: the repr of plain JSON-like
    data (it tells a tuple from a list, 1 from True and "1" from 1, which a template may print
    differently). None when the input holds anything else (an object's repr may not say what it
    renders to), so that it is rendered every time."""
    data = (messages, tools, add_generation_prompt)
    try:
        json.dumps(data, check_circular=False, allow_nan=True)
    except (TypeError, ValueError):
        return None
    return repr(data)


class AddedTokenSplitEncoder:
    """Encodes text as a Hugging Face fast tokenizer does, reusing the ids of the pieces between
    its added tokens (special tokens such as <|im_start|>).

    A fast tokenizer cuts its input at added tokens before normalizing and pre-tokenizing it, so
    encode(A + S + B) == encode(A) + [id(S)] + encode(B) for an added token S, provided that S
    strips nothing around it (lstrip, rstrip), matches on the raw text (normalized False) and not
    only as a whole word (single_word), that special tokens are not split (split_special_tokens),
    and that no pre-tokenizer treats the input's first piece differently. `for_tokenizer` checks
    these and gives None when any fails. Pieces are cut leftmost-longest, as the tokenizer matches.
    """

    def __init__(self, tokenizer: Any, added: dict[str, int], capacity_chars: int) -> None:
        self._tokenizer = tokenizer
        self._backend = tokenizer.backend_tokenizer
        self._added = added
        self._vocab_size = self._backend.get_vocab_size(with_added_tokens=True)
        by_length = sorted(added, key=len, reverse=True)
        self._pattern = re.compile("(" + "|".join(re.escape(token) for token in by_length) + ")")
        self._pieces: BoundedCache[list[int]] = BoundedCache(
            capacity_chars, lambda piece, ids: len(str(piece)) + len(ids)
        )

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, capacity_chars: int = 8_000_000) -> AddedTokenSplitEncoder | None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None or getattr(tokenizer, "split_special_tokens", False):
            return None
        if getattr(backend, "encode_special_tokens", True):
            return None
        added = backend.get_added_tokens_decoder()
        if not added or any(t.lstrip or t.rstrip or t.single_word or t.normalized for t in added.values()):
            return None
        try:
            document = json.loads(backend.to_str())
        except (ValueError, TypeError):
            return None
        stages = json.dumps([document.get("normalizer"), document.get("pre_tokenizer")])
        if any(name in stages for name in _POSITION_DEPENDENT):
            return None
        return cls(tokenizer, {token.content: token_id for token_id, token in added.items()}, capacity_chars)

    def still_valid(self) -> bool:
        """False once tokens were added to the tokenizer, or it was set to truncate or pad."""
        backend = self._backend
        return (
            backend.get_vocab_size(with_added_tokens=True) == self._vocab_size
            and backend.truncation is None
            and backend.padding is None
        )

    def encode(self, text: str) -> list[int]:
        # split() with a group: pieces of text at even indices, the added tokens between them odd.
        parts = self._pattern.split(text)
        pieces = parts[::2]
        known: dict[str, list[int]] = {}
        missing = []
        for piece in pieces:
            if piece not in known:
                cached = self._pieces.get(piece)
                if cached is None:
                    missing.append(piece)
                else:
                    known[piece] = cached
        if missing:
            missing = list(dict.fromkeys(missing))
            for piece, encoding in zip(missing, self._backend.encode_batch(missing, add_special_tokens=False)):
                known[piece] = encoding.ids
                self._pieces.put(piece, encoding.ids)
        ids: list[int] = list(known[pieces[0]])
        added = self._added
        for token, piece in zip(parts[1::2], pieces[1:]):
            ids.append(added[token])
            ids += known[piece]
        return ids
