"""Streamed replies: what a session's streaming calls yield, and which part of a reply that is
still being generated may be shown.

A streaming call (`GatewaySession.chat_stream`, `complete_stream`) yields `TextDelta`s as the
tokens arrive, then one `CallDone` with what the whole call returns. Each API's module maps those
two to its own events; the text deltas joined are exactly the final content.

Content deltas never show what the final content will not, so text that may still turn out to be
something else is held back (`ContentHoldback`) until it cannot, or until the end:
- an incomplete character (the decoded text ends in U+FFFD while its bytes are split);
- a stop string, and any end of the text that could be the start of one (the content ends where
  the stop string begins);
- when the request declared tools: everything from the first place where tool-call markup may
  begin (the session's format: HERMES `<tool_call>`, FENCED_BASH ```` ```bash ````/```` ```sh ```` blocks
  and `SUBMIT` lines), since whether it is a call (removed from the content) or text (kept, when
  it does not parse) is known only at the end; whitespace at the end of the text shown so far
  (the content is trimmed when calls are read); and a reply that begins with whitespace is held
  whole, because whether that whitespace is content depends on whether calls follow.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from corral.rollout.tool_calls import ToolCallFormat
from corral.rollout.types import ChatTokenizer

if TYPE_CHECKING:
    from corral.rollout.gateway.render import Message
    from corral.rollout.gateway.session import CallResult

log = logging.getLogger(__name__)

_HERMES_MARKERS = ("<tool_call>",)
_FENCED_MARKERS = ("```bash", "```sh")
_SUBMIT_LINE = re.compile(r"[ \t]*SUBMIT[ \t]*")


@dataclass(frozen=True)
class TextDelta:
    """Content the reply goes on with (never empty)."""

    text: str


@dataclass(frozen=True)
class CallDone:
    """The call is generated and recorded: the result and, for a chat call, the assistant message,
    exactly as the whole call returns them."""

    result: CallResult
    reply: Message | None = None


StreamEvent = TextDelta | CallDone


class ContentHoldback:
    """The content of a reply as its ids arrive: `feed` returns the text that may be shown now,
    `rest` the remainder once the final content is known."""

    def __init__(
        self,
        tokenizer: ChatTokenizer,
        end_of_turn: frozenset[int],
        stops: Sequence[str],
        tool_call_format: ToolCallFormat | None,
        max_ids: int,
    ) -> None:
        self._tokenizer = tokenizer
        self._end_of_turn = end_of_turn
        self._stops = [stop for stop in stops if stop]
        self._format = tool_call_format
        self._max_ids = max_ids
        self._ids: list[int] = []
        self._decoded = IncrementalText(tokenizer)
        self.shown = ""

    def feed(self, ids: Sequence[int]) -> str:
        """Takes the next generated ids (past `max_ids` they are ignored, as the session cuts the
        reply there); returns the text newly safe to show ("" when none)."""
        ids = list(ids[: self._max_ids - len(self._ids)])
        if not ids:
            return ""
        self._ids += ids
        end = len(self._ids)
        while end and self._ids[end - 1] in self._end_of_turn:
            end -= 1
        text = self._decoded.text(self._ids[:end])
        safe = text[: self.safe_length(text)]
        if len(safe) <= len(self.shown) or not safe.startswith(self.shown):
            return ""
        new, self.shown = safe[len(self.shown) :], safe
        return new

    def rest(self, content: str) -> str:
        """What follows the text shown, given the final content."""
        if not content.startswith(self.shown):  # never expected: the rules above are conservative
            log.warning("a streamed reply showed text its final content does not start with")
            return ""
        return content[len(self.shown) :]

    def safe_length(self, text: str) -> int:
        """How much of `text` (the reply so far) is the start of the final content, whatever
        follows."""
        cut = len(text.rstrip("\ufffd"))
        for stop in self._stops:
            cut = min(cut, _marker_start(text, stop))
        if self._format is None:
            return cut
        markers = _HERMES_MARKERS if self._format is ToolCallFormat.HERMES else _FENCED_MARKERS
        for marker in markers:
            cut = min(cut, _marker_start(text, marker))
        if self._format is ToolCallFormat.FENCED_BASH:
            cut = min(cut, _submit_line_start(text))
        shown = text[:cut]
        if shown[:1].isspace():
            return 0
        return len(shown.rstrip())


class IncrementalText:
    """The text of a growing id sequence, decoding only its end: the text of the ids up to a
    settled point is kept, and the ids after it are decoded together with a few before it, whose
    own text is then cut off (a tokenizer may write a token differently at the start of a text:
    SentencePiece drops its leading space). The settled point moves on while the text before it is
    whole characters. Whenever the pieces do not fit (the context's text is not where the longer
    decoding begins), it decodes everything: the result is always the tokenizer's decode."""

    CONTEXT = 4  # ids decoded before the settled point, for the tokenizer's context
    WINDOW = 16  # ids left unsettled at the end

    def __init__(self, tokenizer: ChatTokenizer) -> None:
        self._decode = tokenizer.decode
        self._settled = 0  # ids whose text is `_settled_text`
        self._settled_text = ""
        self._context_text = ""  # the text of the CONTEXT ids before the settled point, alone

    def text(self, ids: Sequence[int]) -> str:
        settled = self._settled
        if settled > len(ids):
            return self._decode(ids)
        start = max(0, settled - self.CONTEXT)
        tail = self._decode(ids[start:])
        if not tail.startswith(self._context_text):
            return self._decode(ids)
        text = self._settled_text + tail[len(self._context_text) :]
        if len(ids) - settled >= 2 * self.WINDOW:
            self._settle(ids, len(ids) - self.WINDOW)
        return text

    def _settle(self, ids: Sequence[int], point: int) -> None:
        start = max(0, self._settled - self.CONTEXT)
        piece = self._decode(ids[start:point])
        if not piece.startswith(self._context_text) or piece.endswith("\ufffd"):
            return  # not a clean point: try again later
        self._settled_text += piece[len(self._context_text) :]
        self._settled = point
        self._context_text = self._decode(ids[max(0, point - self.CONTEXT) : point])


def _marker_start(text: str, marker: str) -> int:
    """Where `marker` first occurs in `text`, or where an end of `text` that begins it starts;
    len(text) when neither."""
    at = text.find(marker)
    if at >= 0:
        return at
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:length]):
            return len(text) - length
    return len(text)


def _submit_line_start(text: str) -> int:
    """Where the first line that is (or, the last one, may become) a FENCED_BASH `SUBMIT` line
    starts; len(text) when none."""
    start = 0
    while True:
        newline = text.find("\n", start)
        line = text[start:] if newline < 0 else text[start:newline]
        if newline < 0:
            body = line.lstrip(" \t")
            if "SUBMIT".startswith(body) or (body.startswith("SUBMIT") and not body[6:].strip(" \t")):
                return start
            return len(text)
        if _SUBMIT_LINE.fullmatch(line):
            return start
        start = newline + 1
