"""Builds a tiny Qwen2-style causal LM with random weights, a byte-level BPE tokenizer trained on
the bundled task prompts and a ChatML chat template: a real model directory that vLLM (and
transformers) load, made offline in seconds, for tests that need a real inference engine.

    python scripts/build_tiny_model.py OUT_DIR

Deterministic: the same inputs (this script and its training text) give the same files. OUT_DIR
keeps the content hash of those inputs in BUILD_HASH; a directory whose hash matches is kept as it
is (the cache), any other content is replaced. Prints OUT_DIR.

The model is random, so what it generates is noise: it exercises the engine and the client (token
ids, logprobs, stop conditions, lengths), never a task's success.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROMPTS = REPO / "examples" / "tasks" / "repair.jsonl"
HASH_FILE = "BUILD_HASH"
SEED = 0
VOCAB_SIZE = 1024  # more than the corpus fills: every word of it becomes one token
HIDDEN_SIZE = 128
LAYERS = 2
HEADS = 2  # head size 64: one every CPU attention backend supports
KV_HEADS = 1
MAX_POSITIONS = 2048

IM_START, IM_END, END_OF_TEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
SPECIAL_TOKENS = [END_OF_TEXT, IM_START, IM_END]

# ChatML as Qwen2 writes it, without the default system message.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Text in the shape the agent loop writes (tool instructions, tool calls, observations), so that
# the tokenizer has merges for it besides the prompts' prose.
EXTRA_CORPUS = [
    '<tool_call>{"name": "bash", "arguments": {"command": "python3 -m unittest"}}</tool_call>',
    '<tool_call>{"name": "editor", "arguments": {"command": "view", "path": "calc.py"}}</tool_call>',
    '<tool_call>{"name": "submit", "arguments": {}}</tool_call>',
    "Error: your reply has no tool call.",
    'Ran 3 tests in 0.001s\n\nOK\nTraceback (most recent call last):\n  File "test.py", line 1',
    "```bash\nls -la\n```\nSUBMIT",
]


def corpus() -> list[str]:
    """The training text: every message of the bundled tasks, the agent loop's tool instructions
    and format reminders, then the tool-call shapes."""
    from corral.rollout.tool_calls import ToolCallFormat
    from corral.rollout.tools import TOOL_SPECS, format_reminder, tool_instructions

    texts: list[str] = []
    for fmt in ToolCallFormat:
        texts += [tool_instructions(TOOL_SPECS, fmt), format_reminder(fmt)]
    for line in PROMPTS.read_text().splitlines():
        if line.strip():
            task = json.loads(line)
            fields = task["prompt"].get("fields", {})
            for message in task["prompt"]["messages"]:
                content = message["content"]
                for name, value in fields.items():
                    content = content.replace("{" + name + "}", value)
                texts.append(content)
    return texts + EXTRA_CORPUS


def content_hash(texts: list[str]) -> str:
    digest = hashlib.sha256()
    digest.update(Path(__file__).read_bytes())
    digest.update("\0".join(texts).encode())
    return digest.hexdigest()[:16]


def train_tokenizer(texts: list[str]):  # -> transformers.PreTrainedTokenizerFast
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=IM_END,
        pad_token=END_OF_TEXT,
        chat_template=CHAT_TEMPLATE,
        model_max_length=MAX_POSITIONS,
    )


def build_model(tokenizer, out: Path) -> None:
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=HIDDEN_SIZE,
        intermediate_size=HIDDEN_SIZE * 2,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.convert_tokens_to_ids(END_OF_TEXT),
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        dtype="float32",
    )
    torch.manual_seed(SEED)
    model = Qwen2ForCausalLM(config)  # float32, the default dtype
    model.save_pretrained(out, safe_serialization=True)
    # No sampling defaults: requests say what they want.
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id).save_pretrained(out)


def build(out: Path) -> Path:
    texts = corpus()
    wanted = content_hash(texts)
    hash_file = out / HASH_FILE
    if hash_file.is_file() and hash_file.read_text().strip() == wanted:
        return out
    staging = out.with_name(out.name + ".building")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    tokenizer = train_tokenizer(texts)
    tokenizer.save_pretrained(staging)
    build_model(tokenizer, staging)
    (staging / HASH_FILE).write_text(wanted + "\n")
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the model directory to build (kept when up to date)")
    args = parser.parse_args(argv)
    print(build(args.out.resolve()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
