"""The built-in tiny policy's network: a small GRU language model over the byte tokenizer's
vocabulary (`ByteChatTokenizer`: 256 bytes + 3 ChatML special tokens).

A trainer builds the same architecture with `TinyByteLM(**config)`, trains it with
`token_logprobs`, and saves `model.state_dict()` (or `{"config": model.config, "state_dict": ...}`)
with `torch.save`; the reference server loads that file through POST /update_weights_from_disk.
With the default sizes it has about 220k parameters and generates a few thousand tokens a second
on one CPU core.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from corral.rollout.tokenizer import ByteChatTokenizer

VOCAB_SIZE = ByteChatTokenizer().vocab_size


class TinyByteLM(nn.Module):
    """Embedding -> multi-layer GRU -> linear head. The recurrent state makes incremental decoding
    O(1) per token: `forward(ids, state)` continues from `state`."""

    def __init__(
        self, vocab_size: int = VOCAB_SIZE, embed_dim: int = 64, hidden_dim: int = 128, num_layers: int = 2
    ) -> None:
        super().__init__()
        self.config: dict[str, int] = {
            "vocab_size": vocab_size,
            "embed_dim": embed_dim,
            "hidden_dim": hidden_dim,
            "num_layers": num_layers,
        }
        self.embed = nn.Embedding(vocab_size, embed_dim)
        self.rnn = nn.GRU(embed_dim, hidden_dim, num_layers=num_layers, batch_first=True)
        self.head = nn.Linear(hidden_dim, vocab_size)

    @property
    def vocab_size(self) -> int:
        return self.config["vocab_size"]

    def forward(self, ids: torch.Tensor, state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [batch, time] (int64) -> (logits [batch, time, vocab], state [layers, batch,
        hidden]). Logits at position t predict the token at t + 1."""
        hidden, state = self.rnn(self.embed(ids), state)
        return self.head(hidden), state

    def token_logprobs(self, ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """ids [batch, time] -> [batch, time - 1]: the log-probability of each token ids[:, t]
        (t >= 1) given ids[:, :t], under softmax(logits / temperature) (temperature <= 0 is taken
        as 1). The same quantity the tiny policy reports as a sampled token's logprob."""
        logits, _ = self(ids[:, :-1])
        if temperature > 0:
            logits = logits / temperature
        return F.log_softmax(logits.float(), dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    @classmethod
    def from_checkpoint(cls, obj: Any) -> TinyByteLM:
        """A model built from what `torch.load` returned: a bare state dict (default sizes, or
        sizes inferred from its shapes) or {"config": ..., "state_dict": ...}."""
        config, state_dict = split_checkpoint(obj)
        model = cls(**(config or infer_config(state_dict)))
        model.load_state_dict(state_dict)
        return model


def split_checkpoint(obj: Any) -> tuple[dict[str, int] | None, dict[str, torch.Tensor]]:
    """(config or None, state dict) of a checkpoint object; ValueError when it is neither a state
    dict nor {"state_dict"/"model": state dict, optional "config"}."""
    if not isinstance(obj, dict):
        raise ValueError(f"a checkpoint must be a state dict, not {type(obj).__name__}")
    for key in ("state_dict", "model"):
        if isinstance(obj.get(key), dict):
            config = obj.get("config")
            return (dict(config) if isinstance(config, dict) else None), obj[key]
    if obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
        return None, obj
    raise ValueError("a checkpoint must be a state dict or {'state_dict': ..., 'config': ...}")


def infer_config(state_dict: dict[str, torch.Tensor]) -> dict[str, int]:
    """The TinyByteLM sizes that match a state dict's shapes."""
    try:
        vocab_size, embed_dim = state_dict["embed.weight"].shape
        hidden_dim = state_dict["head.weight"].shape[1]
    except KeyError as error:
        raise ValueError(f"not a TinyByteLM state dict (no {error.args[0]})") from None
    num_layers = sum(1 for key in state_dict if key.startswith("rnn.weight_ih_l"))
    return {
        "vocab_size": int(vocab_size),
        "embed_dim": int(embed_dim),
        "hidden_dim": int(hidden_dim),
        "num_layers": num_layers,
    }
