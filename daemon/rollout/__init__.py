"""Rollouts: tasks in, token-exact trajectories with rewards out.

- `types`: the shared vocabulary (generations, tool calls, trajectories, the tokenizer protocol).
- `tokenizer`: chat tokenizers (a built-in byte-level one; Hugging Face ones from a local path).
- `tool_calls`, `tools`, `agent_loop`: the token-in/token-out agent loop and the tools it calls.
- `llm`: LLM server clients (SGLang, vLLM), the server pool, and the built-in reference server.
- `tasks`, `evaluation`, `pipeline`: tasks, rewards, and the INIT / RUN / EVAL stages.
"""
