"""Stitching a rollout's LLM calls into trainable token sequences (samples), exactly.

Pure (no I/O): the session asks `plan_chat` / `plan_tokens` what a call's prompt ids are, sends
them to the LLM, and hands the generation back to `commit`. A call that is refused or fails after
planning leaves the assembler as it was.

The rules, for a chat call with conversation M after a call that asked conversation A and got the
reply R (the assistant message exactly as the gateway returned it):

- EXTEND: M keeps A's tools, starts with A's messages exactly, and its next message is R as a
  harness may send it back (`render.same_reply`: tool-call arguments compared as objects, content
  up to surrounding whitespace, None and "" alike). The prompt is the recorded ids (the sample's
  prompt and response ids, which end with R's generated ids) followed by the tokenizer's
  continuation after R (its closing, the messages after R, the generation prompt). R's turn joins
  the sample with that continuation as its observation (mask 0). M is also rendered in full: when
  that equals the prompt the call is a prefix hit, otherwise a splice (the recorded ids are what
  the LLM gets, never a re-tokenization).
- RETRY: M is A again (same messages, same tools): the harness dropped R and asks again. R is
  discarded (it is in no sample) and the call is generated from A's prompt ids.
- NEW: anything else (the history was truncated, summarized, edited; the tools or system prompt
  changed). By policy SPLIT or MASK the current sample is closed (R's turn appended without an
  observation) and a new sample starts from M's full rendering; FAIL raises HistoryRewritten and
  every later call of the rollout does too.

A completions call (prompt ids) EXTENDs when the recorded ids are a prefix of its prompt (the rest
is the observation; always a prefix hit), is a RETRY when it repeats the last prompt's ids, and is
otherwise NEW under the same policy. A chat call after a completions call, having no recorded
conversation to compare with, is NEW.

Closing appends the pending turn without an observation. Under MASK, when the rollout produced more
than one sample, every sample's response_mask is set to all 0 (the data is kept for inspection and
the token counts, but no token is trained on); one sample is delivered as is.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields

from corral.rollout.gateway.errors import HistoryRewritten
from corral.rollout.gateway.render import ChatRenderer, Conversation, Message, same_reply
from corral.rollout.types import Trajectory, TurnRecord


class HistoryPolicy(str, enum.Enum):
    SPLIT = "split"  # a call whose messages do not extend the previous call's conversation starts a new sample
    MASK = "mask"  # same segmentation as SPLIT, but every sample of the rollout is delivered with response_mask all 0
    FAIL = "fail"  # that call is answered HTTP 409 and the rollout ends FILTERED (history_rewritten)


@dataclass
class GatewayCounters:
    calls: int = 0  # generation requests answered (chat + completions)
    prefix_hits: int = 0  # calls whose full re-rendered prompt equals recorded ids + continuation exactly
    splices: int = 0  # calls whose re-rendering differed: recorded ids were kept (spliced), never re-tokenized
    splits: int = 0  # new samples started because the history was not append-only
    masked_samples: int = 0  # samples delivered with mask 0 (MASK policy)
    discarded: int = 0  # calls whose reply the harness dropped (it re-sent the same conversation): not in any sample

    def add(self, other: GatewayCounters) -> None:
        for counter in fields(self):
            setattr(self, counter.name, getattr(self, counter.name) + getattr(other, counter.name))


class CallKind(str, enum.Enum):
    EXTEND = "extend"
    RETRY = "retry"
    NEW = "new"


@dataclass(frozen=True)
class CallPlan:
    kind: CallKind
    prompt_ids: list[int]
    # EXTEND: the ids between the previous reply and this call's generation (mask 0).
    observation_ids: list[int] = field(default_factory=list)
    # EXTEND of a chat call: whether M's full rendering equals prompt_ids (prefix hit vs splice).
    rerender_matches: bool = True
    # The chat call's conversation; None for a completions call.
    conversation: Conversation | None = None


@dataclass
class _SampleText:
    """What a sample's `messages` are made of when it is closed: the last conversation asked in
    it and the raw text of the reply to it."""

    conversation: Conversation | None = None
    reply_text: str = ""


class TrajectoryAssembler:
    """One rollout's samples (see the module docstring for the rules)."""

    def __init__(self, renderer: ChatRenderer, policy: HistoryPolicy, counters: GatewayCounters | None = None) -> None:
        self.renderer = renderer
        self.policy = policy
        self.counters = counters if counters is not None else GatewayCounters()
        self.history_rewritten: str | None = None
        self._samples: list[Trajectory] = []
        self._current: Trajectory | None = None
        self._current_text = _SampleText()
        self._pending: TurnRecord | None = None  # the last reply's turn: no observation yet
        self._asked: Conversation | None = None  # the conversation the pending reply answers
        self._reply: Message | None = None  # the pending reply as returned (normalized)
        self._last_prompt_ids: list[int] = []
        self._closed = False

    # Planning (no state change except the FAIL policy's verdict).

    def plan_chat(self, conversation: Conversation) -> CallPlan:
        self._check_open()
        if self._pending is None or self._asked is None or self._reply is None:
            return CallPlan(CallKind.NEW, self.renderer.encode_prompt(conversation), conversation=conversation)
        if conversation == self._asked:
            return CallPlan(CallKind.RETRY, list(self._last_prompt_ids), conversation=conversation)
        divergence = self._divergence(conversation)
        if divergence is None:
            asked = self._asked
            new_messages = conversation.messages[len(asked.messages) + 1 :]
            observation = self.renderer.encode_continuation(asked, self._pending.generated_ids, new_messages)
            prompt = self._recorded_ids() + observation
            matches = self.renderer.encode_prompt(conversation) == prompt
            return CallPlan(CallKind.EXTEND, prompt, observation, matches, conversation)
        self._rewritten(divergence)
        return CallPlan(CallKind.NEW, self.renderer.encode_prompt(conversation), conversation=conversation)

    def plan_tokens(self, prompt_ids: list[int]) -> CallPlan:
        self._check_open()
        if self._pending is None:
            return CallPlan(CallKind.NEW, list(prompt_ids))
        if prompt_ids == self._last_prompt_ids:
            return CallPlan(CallKind.RETRY, list(prompt_ids))
        recorded = self._recorded_ids()
        if prompt_ids[: len(recorded)] == recorded:
            return CallPlan(CallKind.EXTEND, list(prompt_ids), prompt_ids[len(recorded) :])
        self._rewritten("the prompt ids do not extend the previous call's prompt and completion")
        return CallPlan(CallKind.NEW, list(prompt_ids))

    def _divergence(self, conversation: Conversation) -> str | None:
        """Why `conversation` does not extend the recorded one; None when it does."""
        assert self._asked is not None and self._reply is not None
        asked = self._asked.messages
        if conversation.tools != self._asked.tools:
            return "the tools differ from the previous call's"
        for index, (before, now) in enumerate(zip(asked, conversation.messages)):
            if before != now:
                return f"messages[{index}] ({now['role']}) differs from the previous call's"
        if len(conversation.messages) <= len(asked):
            return (
                f"the conversation has {len(conversation.messages)} messages, fewer than the {len(asked) + 1} recorded"
            )
        if not same_reply(self._reply, conversation.messages[len(asked)]):
            return f"messages[{len(asked)}] is not the assistant reply the gateway returned"
        return None

    def _rewritten(self, reason: str) -> None:
        if self.policy is HistoryPolicy.FAIL:
            self.history_rewritten = f"the harness rewrote the history: {reason}"
            raise HistoryRewritten(self.history_rewritten)

    def _check_open(self) -> None:
        if self.history_rewritten is not None:
            raise HistoryRewritten(self.history_rewritten)
        if self._closed:
            raise RuntimeError("the assembler is closed")

    def _recorded_ids(self) -> list[int]:
        assert self._current is not None and self._pending is not None
        return self._current.prompt_ids + self._current.response_ids + self._pending.generated_ids

    # Recording.

    def commit(self, plan: CallPlan, turn: TurnRecord, reply: Message | None, reply_text: str) -> int:
        """Records the generation `turn` (observation_ids empty) made from `plan`; `reply` is the
        assistant message returned for a chat call (normalized), `reply_text` the raw text of the
        generated ids. Returns the call's index in the rollout."""
        self._check_open()
        if plan.kind is CallKind.EXTEND:
            assert self._current is not None and self._pending is not None
            self._pending.observation_ids = list(plan.observation_ids)
            self._current.append_turn(self._pending)
            if plan.rerender_matches:
                self.counters.prefix_hits += 1
            else:
                self.counters.splices += 1
        elif plan.kind is CallKind.RETRY:
            self.counters.discarded += 1
        else:
            if self._current is not None:
                self._close_current()
                self.counters.splits += 1
            self._current = Trajectory(prompt_ids=list(plan.prompt_ids))
        assert self._current is not None
        turn.index = len(self._current.turns)
        self._pending = turn
        self._asked = plan.conversation
        self._reply = reply
        self._last_prompt_ids = list(plan.prompt_ids)
        self._current_text = _SampleText(plan.conversation, reply_text)
        call_index = self.counters.calls
        self.counters.calls += 1
        return call_index

    def _close_current(self) -> None:
        assert self._current is not None
        if self._pending is not None:
            self._current.append_turn(self._pending)
        text = self._current_text
        if text.conversation is not None:
            messages = self.renderer.template_messages(text.conversation.messages, text.conversation.tools)
            self._current.messages = [*messages, {"role": "assistant", "content": text.reply_text}]
        self._samples.append(self._current)
        self._current, self._pending, self._asked, self._reply = None, None, None, None

    def close(self) -> list[Trajectory]:
        """The rollout's samples, in order; nothing more is recorded afterwards."""
        if self._closed:
            return self._samples
        if self._current is not None:
            self._close_current()
        self._closed = True
        if self.policy is HistoryPolicy.MASK and len(self._samples) > 1:
            for sample in self._samples:
                sample.response_mask = [0] * len(sample.response_mask)
            self.counters.masked_samples += len(self._samples)
        return self._samples

    @property
    def sample_count(self) -> int:
        return len(self._samples) + int(self._current is not None)
