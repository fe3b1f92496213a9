"""corral.rollout: the rollout engine. Tasks in, token-exact trajectories with rewards out.

A client-side library: it drives sandboxes through `corral.sdk` and nothing else, so it runs in
the daemon (the RolloutService) and in a trainer's own process (tools mode) alike.

- `types`: the shared vocabulary (generations, tool calls, trajectories, the tokenizer protocol).
- `tokenizer`: chat tokenizers (a built-in byte-level one; Hugging Face ones from a local path).
- `tool_calls`, `tools`, `agent_loop`: the token-in/token-out agent loop and the tools it calls.
- `llm`: token-in/token-out clients of SGLang and vLLM servers.
- `tasks`, `prompt`, `evaluation`, `pipeline`, `results`: tasks, rewards, the INIT / RUN / EVAL
  stages and the result messages.
- `reference`: an LLM server to test and demo with (replay of reference solutions, a tiny torch
  model), importable like a testing package.
"""
