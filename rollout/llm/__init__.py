"""Token-in/token-out LLM server clients: SGLang (/generate) and vLLM (/v1/completions), and the
routing header that keeps a rollout's requests on one server."""
