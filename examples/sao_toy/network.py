"""The policy network, its checkpoints, and a logprob function that shares the prompt's common
prefix.

The network is the built-in tiny policy's `TinyByteLM` (a byte-level GRU); the reference server
serves the same architecture (`TinyPolicy(model=...)`) and loads what `save_checkpoint` writes.

Every prompt of the task set starts with the same ~360 ids (the system message and the daemon's
tool instructions), and recomputing them for each rollout would be most of a training step's
cost. `SharedPrefixLogprobs` runs that prefix once per set of weights and continues each rollout
from its final state. With gradients on, the prefix's graph is shared by every rollout of the
step, so the gradient is exact (the same as running each whole sequence), only cheaper.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch

from corral.rollout.reference.tiny_model import TinyByteLM

# Small enough to train and sample on two CPU cores next to the sandboxes; big enough to tell the
# six variants apart after a short warm start (measured: see README.md).
MODEL_CONFIG = {"embed_dim": 32, "hidden_dim": 256, "num_layers": 1}


def build_model(seed: int, config: dict[str, int] | None = None) -> TinyByteLM:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return TinyByteLM(**(config or MODEL_CONFIG))


def save_checkpoint(model: TinyByteLM, path: str | Path) -> Path:
    """{"config", "state_dict"} with torch.save, written to a temporary name and renamed, so the
    server never reads a half-written file."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"config": dict(model.config), "state_dict": model.state_dict()}, tmp)
    os.replace(tmp, path)
    return path


def load_checkpoint(path: str | Path) -> TinyByteLM:
    return TinyByteLM.from_checkpoint(torch.load(str(path), map_location="cpu", weights_only=True))


def common_prefix(sequences: Sequence[Sequence[int]]) -> list[int]:
    first = list(sequences[0])
    length = len(first)
    for other in sequences[1:]:
        length = next((i for i, (a, b) in enumerate(zip(first, other)) if a != b), min(length, len(other)))
    return first[:length]


class SharedPrefixLogprobs:
    """logprob_fn(model, prompt_ids, response_ids) for StreamingLearner and the GRPO loop: the
    logprob of each response id under softmax(logits / temperature), as `tiny_byte_lm_logprobs`
    computes it, but with `prefix` (a prefix of every prompt) run once per weights.

    The cached prefix state is reused while the parameters are unchanged (their in-place version
    counters, which optimizer steps bump), grad mode is the same and no backward pass has gone
    through it; a prompt that does not start with the prefix is computed whole."""

    def __init__(self, prefix: Sequence[int], temperature: float = 1.0) -> None:
        self.prefix = list(prefix)
        self.temperature = temperature
        self._key: tuple | None = None
        self._state: torch.Tensor | None = None
        self.prefix_runs = 0

    def _prefix_state(self, model: TinyByteLM) -> torch.Tensor:
        key = (id(model), torch.is_grad_enabled(), tuple(p._version for p in model.parameters()))
        if key != self._key or self._state is None:
            _, state = model(torch.tensor([self.prefix], dtype=torch.long))
            if state.requires_grad:
                # A backward pass frees the prefix's graph: the next call must rebuild it.
                state.register_hook(self._forget)
            self._state, self._key = state, key
            self.prefix_runs += 1
        return self._state

    def _forget(self, grad: torch.Tensor) -> None:
        self._state = self._key = None

    def __call__(self, model: TinyByteLM, prompt_ids: Sequence[int], response_ids: Sequence[int]) -> torch.Tensor:
        prompt, response = list(prompt_ids), list(response_ids)
        cut = len(self.prefix)
        if len(prompt) <= cut or prompt[:cut] != self.prefix:
            ids = torch.tensor([prompt + response], dtype=torch.long)
            return model.token_logprobs(ids, self.temperature)[0, len(prompt) - 1 :]
        suffix = torch.tensor([prompt[cut:] + response], dtype=torch.long)
        logits, _ = model(suffix[:, :-1], self._prefix_state(model))
        if self.temperature > 0:
            logits = logits / self.temperature
        logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, suffix[:, 1:, None]).squeeze(-1)[0]
        # logits[j] predicts suffix[j + 1]; the first response id is suffix[len(prompt) - cut].
        return logprobs[len(prompt) - cut - 1 :]

    def reply_logits(
        self, model: TinyByteLM, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]
    ) -> list[torch.Tensor]:
        """Per rollout, the raw logits that predict each response id ([len(response), vocab]), for
        many rollouts in one batched pass (right-padded); every prompt must start with the prefix."""
        cut = len(self.prefix)
        suffixes = [list(p[cut:]) + list(r) for p, r in zip(prompts, responses)]
        width = max(len(s) for s in suffixes)
        ids = torch.zeros(len(suffixes), width, dtype=torch.long)
        for row, suffix in enumerate(suffixes):
            ids[row, : len(suffix)] = torch.tensor(suffix)
        state = self._prefix_state(model).expand(-1, len(suffixes), -1).contiguous()
        logits, _ = model(ids[:, :-1], state)
        # logits[j] predicts suffix[j + 1]; the first response id is suffix[len(prompt) - cut].
        return [
            logits[row, len(p) - cut - 1 : len(p) - cut - 1 + len(r)]
            for row, (p, r) in enumerate(zip(prompts, responses))
        ]

    def batch(
        self, model: TinyByteLM, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]
    ) -> list[torch.Tensor]:
        """What `__call__` gives, for many rollouts in one batched pass (see `reply_logits`)."""
        out = []
        for logits, response in zip(self.reply_logits(model, prompts, responses), responses):
            if self.temperature > 0:
                logits = logits / self.temperature
            targets = torch.tensor(list(response), dtype=torch.long)
            out.append(torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[:, None]).squeeze(-1))
        return out
