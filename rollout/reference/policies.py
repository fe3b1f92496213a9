"""What the built-in reference server asks of a policy, and how it reads SGLang's sampling
parameters into it. The policies themselves: `replay.ReplayPolicy` (plays a task's reference
solution back) and `tiny.TinyPolicy` (a small torch model that really samples).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol


class PolicyError(ValueError):
    """The request cannot be served as asked (unknown prompt, bad parameters, unusable
    checkpoint); the server answers 400 with the message."""


@dataclass(frozen=True)
class GenerateParams:
    """SGLang's sampling_params, the subset the built-in policies honour."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0): no limit
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Per-request seed (SGLang's `sampling_seed`); None: the policy's own seeded generator.
    seed: int | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_sglang(cls, params: Mapping[str, Any] | None) -> GenerateParams:
        """Reads SGLang's `sampling_params` object; PolicyError on a malformed value."""
        try:
            params = dict(params or {})
            stop = params.pop("stop", None) or ()
            if isinstance(stop, str):
                stop = (stop,)
            seed = params.pop("sampling_seed", params.pop("seed", None))
            parsed = cls(
                max_new_tokens=int(params.pop("max_new_tokens", 128)),
                temperature=float(params.pop("temperature", 1.0)),
                top_p=float(params.pop("top_p", 1.0)),
                top_k=int(params.pop("top_k", -1)),
                stop=tuple(str(s) for s in stop),
                stop_token_ids=tuple(int(i) for i in params.pop("stop_token_ids", None) or ()),
                ignore_eos=bool(params.pop("ignore_eos", False)),
                seed=None if seed is None else int(seed),
                extra=params,
            )
        except (TypeError, ValueError) as error:
            raise PolicyError(f"bad sampling_params: {error}") from None
        if parsed.max_new_tokens < 0:
            raise PolicyError("sampling_params.max_new_tokens must be >= 0")
        if parsed.temperature < 0:
            raise PolicyError("sampling_params.temperature must be >= 0")
        if not 0 < parsed.top_p <= 1:
            raise PolicyError("sampling_params.top_p must be in (0, 1]")
        return parsed


class PolicyOutput(NamedTuple):
    """What a policy generated: ids (the stop token included when it stopped on one), one logprob
    per id, why it stopped ("stop", "length" or "abort"), and what it stopped on (a stop token id,
    a stop string, or None for "length"), and the weight version that generated it (None: the
    policy's current one)."""

    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    matched: int | str | None = None
    weight_version: int | None = None


class Policy(Protocol):
    """A policy behind the reference server. `weight_version` is reported with every generation
    (the version of the weights that generated it)."""

    name: str
    weight_version: int

    async def generate(self, input_ids: list[int], params: GenerateParams) -> PolicyOutput: ...

    async def load_weights(self, path: str, weight_version: int | None) -> int:
        """Loads weights from `path`; returns the new weight version (`weight_version` when given,
        else the old one + 1). PolicyError when this policy has no weights or the file is
        unusable."""
        ...
