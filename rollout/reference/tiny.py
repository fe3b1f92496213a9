"""The tiny policy: `TinyByteLM` sampling for real, with the logprob of every sampled token, so
that a trainer can run actual policy-gradient steps against the built-in server on a CPU.
"""

from __future__ import annotations

import asyncio
import math
import threading
from pathlib import Path

import torch
from torch.nn import functional as F

from corral.rollout.reference.policies import GenerateParams, PolicyError, PolicyOutput
from corral.rollout.reference.tiny_model import TinyByteLM, split_checkpoint
from corral.rollout.tokenizer import END_OF_TEXT, ByteChatTokenizer


class TinyPolicy:
    """Samples from a `TinyByteLM` over the byte tokenizer's vocabulary.

    Sampling: logits / temperature, then top-k, then top-p (nucleus) truncation, then a draw;
    temperature 0 is greedy (argmax). Generation stops after a token in `stop_token_ids` or the
    end-of-sequence token <|endoftext|> (unless `ignore_eos`), when a stop string appears in the
    decoded output, or at max_new_tokens. The stop token is part of the output.

    Logprobs: each sampled token's log-probability under softmax(logits / temperature) of the
    untruncated distribution (temperature 0: under softmax(logits)), i.e. what
    `TinyByteLM.token_logprobs(ids, temperature)` recomputes; top-k/top-p truncation is not
    renormalised into it (as SGLang reports them by default). Train with the same temperature to
    get matching old-policy logprobs.

    Randomness: a request with `sampling_seed` (or `seed`) draws from a generator seeded with it,
    so the same prompt, parameters, seed and weights give the same output; other requests draw
    from the policy's own generator, seeded once with `seed`.

    Generation runs in a worker thread (asyncio.to_thread), one request at a time under a lock
    that weight loading also takes, so a generation never mixes two weight versions and the event
    loop stays free.
    """

    name = "tiny"

    def __init__(
        self,
        model: TinyByteLM | None = None,
        *,
        seed: int = 0,
        checkpoint: str | Path | None = None,
        weight_version: int = 0,
        tokenizer: ByteChatTokenizer | None = None,
    ) -> None:
        self.tokenizer = tokenizer or ByteChatTokenizer()
        if model is None and checkpoint is not None:
            # The checkpoint decides the sizes (see TinyByteLM.from_checkpoint).
            try:
                model = TinyByteLM.from_checkpoint(torch.load(str(checkpoint), map_location="cpu", weights_only=True))
            except Exception as error:  # noqa: BLE001 - torch.load fails in many ways
                raise PolicyError(f"cannot load weights from {checkpoint}: {type(error).__name__}: {error}") from None
            checkpoint = None
        if model is None:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                model = TinyByteLM(vocab_size=self.tokenizer.vocab_size)
        if model.vocab_size != self.tokenizer.vocab_size:
            raise ValueError(
                f"the model's vocabulary has {model.vocab_size} ids, the tokenizer {self.tokenizer.vocab_size}"
            )
        self.model = model.eval()
        self.weight_version = weight_version
        self.eos_id = self.tokenizer.special_ids[END_OF_TEXT]
        self._generator = torch.Generator().manual_seed(seed)
        self._lock = threading.Lock()
        if checkpoint is not None:
            self._load(str(checkpoint))

    async def generate(self, input_ids: list[int], params: GenerateParams) -> PolicyOutput:
        return await asyncio.to_thread(self.generate_sync, input_ids, params)

    def generate_sync(self, input_ids: list[int], params: GenerateParams) -> PolicyOutput:
        if not input_ids:
            raise PolicyError("input_ids is empty")
        vocab = self.tokenizer.vocab_size
        if any(not 0 <= token < vocab for token in input_ids):
            raise PolicyError(f"input_ids must be in [0, {vocab})")
        with self._lock:
            return self._sample(input_ids, params)._replace(weight_version=self.weight_version)

    @torch.inference_mode()
    def _sample(self, input_ids: list[int], params: GenerateParams) -> PolicyOutput:
        generator = self._generator if params.seed is None else torch.Generator().manual_seed(params.seed)
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.add(self.eos_id)
        longest_stop = max((len(s.encode()) for s in params.stop), default=0)
        output_ids: list[int] = []
        logprobs: list[float] = []
        if params.max_new_tokens == 0:
            return PolicyOutput(output_ids, logprobs, "length", None)
        logits, state = self.model(torch.tensor([input_ids], dtype=torch.long))
        last = logits[0, -1].float()
        while True:
            token, logprob = _draw(last, params, generator)
            output_ids.append(token)
            logprobs.append(logprob)
            if token in stop_ids:
                return PolicyOutput(output_ids, logprobs, "stop", token)
            if longest_stop:
                tail = self.tokenizer.decode(output_ids[-(longest_stop + 4) :])
                matched = next((s for s in params.stop if s in tail), None)
                if matched is not None:
                    return PolicyOutput(output_ids, logprobs, "stop", matched)
            if len(output_ids) >= params.max_new_tokens:
                return PolicyOutput(output_ids, logprobs, "length", None)
            logits, state = self.model(torch.tensor([[token]], dtype=torch.long), state)
            last = logits[0, -1].float()

    async def load_weights(self, path: str, weight_version: int | None) -> int:
        return await asyncio.to_thread(self._load, path, weight_version)

    def _load(self, path: str, weight_version: int | None = None) -> int:
        """Loads a checkpoint saved with torch.save (see `TinyByteLM.from_checkpoint`)."""
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True)
            config, state_dict = split_checkpoint(obj)
        except Exception as error:  # noqa: BLE001 - torch.load fails in many ways (pickle, zip, I/O)
            raise PolicyError(f"cannot load weights from {path}: {type(error).__name__}: {error}") from None
        if config is not None and config != self.model.config:
            raise PolicyError(f"the checkpoint's config {config} differs from the served model's {self.model.config}")
        with self._lock:
            try:
                self.model.load_state_dict(state_dict)
            except RuntimeError as error:
                raise PolicyError(f"the checkpoint does not fit the model: {error}") from None
            self.weight_version = self.weight_version + 1 if weight_version is None else weight_version
            return self.weight_version


def _draw(logits: torch.Tensor, params: GenerateParams, generator: torch.Generator) -> tuple[int, float]:
    """(token, its logprob under softmax(logits / temperature)) for one position's logits."""
    if params.temperature <= 0:
        logprobs = F.log_softmax(logits, dim=-1)
        token = int(torch.argmax(logprobs))
        return token, float(logprobs[token])
    scaled = logits / params.temperature
    logprobs = F.log_softmax(scaled, dim=-1)
    filtered = truncated(scaled, params.top_k, params.top_p)
    token = int(torch.multinomial(torch.softmax(filtered, dim=-1), 1, generator=generator))
    return token, float(logprobs[token])


def truncated(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """One position's temperature-scaled logits with -inf outside the top-k, then outside the
    top-p nucleus: the logits of the distribution sampling draws from."""
    filtered = scaled.clone()
    if 0 < top_k < filtered.numel():
        kth = torch.topk(filtered, top_k).values[-1]
        filtered[filtered < kth] = -math.inf
    if top_p < 1.0:
        sorted_logits, order = torch.sort(filtered, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = cumulative - torch.softmax(sorted_logits, dim=-1) >= top_p
        filtered[order[drop]] = -math.inf
    return filtered
