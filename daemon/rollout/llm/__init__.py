"""LLM servers: token-in/token-out clients (SGLang /generate, vLLM /v1/completions), the pool
that spreads rollouts over several servers, and the built-in reference server."""
