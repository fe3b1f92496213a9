"""A reference LLM server for tests, demos and examples, speaking SGLang's /generate protocol:
`ReferenceServer` serving a `Policy` (`ReplayPolicy` replays tasks' reference solutions,
`TinyPolicy` samples a tiny byte-level torch model). What `corral run --llm builtin:*` starts."""
