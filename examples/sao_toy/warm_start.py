"""The warm start: behaviour cloning on the tasks' reference replies, with label smoothing.

A byte-level GRU from random weights cannot find a fenced ```bash block by reinforcement alone in
minutes (its chance of writing one is ~256^-8), so it is first taught by supervised steps on
(prompt, reference reply) pairs: Adam, all six variants per step, cross-entropy on the reply's
ids with label smoothing `smoothing`.

Label smoothing is what leaves reinforcement learning something to do. With smoothing e, the
best the cloned policy can do is put 1 - e (plus e/259) on the right id and spread e over the
others, so a reply of ~30 decisive ids comes out clean at temperature 1 only about (1 - e)^30 of
the time: a low starting reward although the policy already reads the prompt (its greedy reply
is right for every variant). Reinforcement then has to sharpen the policy, which every rollout
of every variant informs.

What we tried first, and why not (measured, see README.md): stopping plain cloning early. The
GRU learns the reply format long before it learns to read the operators in the prompt (a long
plateau where it writes one of the six replies at random), so an early-stopped clone starts at
about 1/6, and policy gradient from there has to learn to read the prompt from a one-in-six
success signal: on-policy, at the best learning rate we found, it went from ~0.45 to ~0.55 in
4,000 rollouts, far from 0.8 in 15 minutes; larger learning rates collapsed the policy.

The phase stops once the greedy reply is right for every variant at `confirm` checks in a row
(the prompt is read), or after `max_steps`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
from network import SharedPrefixLogprobs, build_model, common_prefix
from tasks import VARIANTS, prompt_ids, solution_ids
from torch.nn import functional as F


@dataclass
class WarmStart:
    steps: int = 0
    seconds: float = 0.0
    smoothing: float = 0.0
    # Whether the greedy reply was right for every variant when the phase stopped.
    greedy_correct: bool = False
    # Per variant: probability of sampling its reference reply exactly, at temperature 1.
    exact_probability: dict[str, float] = field(default_factory=dict)
    history: list[dict] = field(default_factory=list)

    @property
    def mean_exact(self) -> float:
        return sum(self.exact_probability.values()) / max(len(self.exact_probability), 1)


def exact_probabilities(model, logprobs: SharedPrefixLogprobs) -> dict[str, float]:
    prompts = [prompt_ids(v) for v in VARIANTS]
    replies = [solution_ids(v) for v in VARIANTS]
    with torch.no_grad():
        values = logprobs.batch(model, prompts, replies)
    return {v.name: math.exp(float(lp.sum())) for v, lp in zip(VARIANTS, values)}


def greedy_correct(model, logprobs: SharedPrefixLogprobs) -> bool:
    """Whether the argmax id is the reference id at every position of every variant's reply
    (teacher-forced: the same as the greedy reply being the reference)."""
    prompts = [prompt_ids(v) for v in VARIANTS]
    replies = [solution_ids(v) for v in VARIANTS]
    with torch.no_grad():
        logits = logprobs.reply_logits(model, prompts, replies)
    return all(bool((row.argmax(-1) == torch.tensor(reply)).all()) for row, reply in zip(logits, replies))


def warm_start(
    seed: int,
    *,
    smoothing: float = 0.05,
    max_steps: int = 800,
    lr: float = 3e-3,
    check_every: int = 10,
    confirm: int = 3,
    log=print,
):
    """(model, WarmStart): see the module docstring."""
    model = build_model(seed)
    prompts = [prompt_ids(v) for v in VARIANTS]
    replies = [solution_ids(v) for v in VARIANTS]
    logprobs = SharedPrefixLogprobs(common_prefix(prompts))
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    report = WarmStart(smoothing=smoothing)
    targets = torch.tensor([i for reply in replies for i in reply])
    confirmed = 0
    started = time.monotonic()
    while report.steps < max_steps:
        logits = torch.cat(logprobs.reply_logits(model, prompts, replies))
        loss = F.cross_entropy(logits, targets, label_smoothing=smoothing)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        report.steps += 1
        if report.steps % check_every:
            continue
        correct = greedy_correct(model, logprobs)
        confirmed = confirmed + 1 if correct else 0
        report.exact_probability = exact_probabilities(model, logprobs)
        report.history.append(
            {
                "step": report.steps,
                "loss": round(float(loss.detach()), 4),
                "mean_exact": round(report.mean_exact, 4),
                "greedy_correct": correct,
            }
        )
        if report.steps % (check_every * 10) == 0:
            log(
                f"  warm start step {report.steps}: loss {float(loss.detach()):.3f}, mean exact-reply "
                f"probability {report.mean_exact:.3f}, greedy reply right for every variant: {correct}"
            )
        if confirmed >= confirm:
            break
    report.greedy_correct = greedy_correct(model, logprobs)
    report.exact_probability = exact_probabilities(model, logprobs)
    report.seconds = time.monotonic() - started
    return model, report
