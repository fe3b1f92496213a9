"""mini-swe-agent as a task harness: `python -m corral.integrations.minisweagent_harness`.

The rollout pipeline's RUN stage runs a harness task's command with the rollout's LLM gateway in
its environment; this entry point runs mini's own `DefaultAgent` and `LitellmModel`, unchanged, on
the task's prompt:

- the model: `openai/$CORRAL_MODEL` at $OPENAI_BASE_URL with $OPENAI_API_KEY (the gateway, whose
  key names the rollout), from mini's tool-calling config (its builtin mini.yaml: one `bash` tool);
- the environment, `--environment corral` (the default, a harness on the host side): corral's
  `CorralEnvironment` attached to the rollout's sandbox ($CORRAL_ADDRESS, $CORRAL_SANDBOX_ID), so
  each action runs there; `--environment local` (a harness inside the sandbox): mini's own
  `LocalEnvironment`; both in $CORRAL_WORKDIR;
- the task: $CORRAL_TASK_PROMPT, which mini's instance template wraps.

`-c SPEC` (repeatable) merges mini config on top of mini.yaml, in mini's own syntax: a YAML file
(a path or a builtin name) or `key.path=value`, e.g. `-c agent.step_limit=20`.

Model calls are not retried: the gateway already retries and fails over between the engines, and
its refusals (max turns reached, context full, unknown key) are final.

Exit status: 0 when the agent finished: it submitted, or it stopped on a limit (its own, or the
gateway's max turns or context window); 1 when the gateway could not be used otherwise (the
rollout is filtered, as for the built-in loop); 2 for bad usage or a missing variable.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

# Before mini and litellm are imported: no banner on stdout, and litellm's model price table from
# the package, not fetched from the network (a sandbox has none).
os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
# One attempt per model call (mini's retry() reads this at each call).
os.environ.setdefault("MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT", "1")

# The gateway's refusals that mean "the episode is over", not "the gateway failed": the error codes
# of rollout.gateway.errors' MaxTurnsExceeded and ContextLengthExceeded.
_LIMIT_CODES = ("max_turns_exceeded", "context_length_exceeded")
_ENVIRONMENTS = ("corral", "local")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m corral.integrations.minisweagent_harness",
        description="Run mini-swe-agent on a corral rollout's task, through the rollout's LLM gateway.",
    )
    parser.add_argument("-c", "--config", action="append", default=[], help="mini config spec merged on top")
    parser.add_argument("--environment", choices=_ENVIRONMENTS, default="corral", help="where actions run")
    parser.add_argument("-o", "--output", help="save mini's trajectory (JSON) here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(name)s: %(message)s")
    try:
        settings = _read_env(args.environment)
        config = _config(args.config, settings)
    except (KeyError, ValueError, FileNotFoundError) as error:
        print(f"minisweagent_harness: {error}", file=sys.stderr)
        return 2
    return _run(config, args.environment, settings, args.output)


def _read_env(environment: str) -> dict[str, str]:
    needed = ["OPENAI_BASE_URL", "OPENAI_API_KEY", "CORRAL_MODEL", "CORRAL_TASK_PROMPT"]
    if environment == "corral":
        needed += ["CORRAL_ADDRESS", "CORRAL_SANDBOX_ID"]
    missing = [name for name in needed if not os.environ.get(name)]
    if missing:
        raise KeyError(f"missing environment variables (set by a harness task's RUN stage): {', '.join(missing)}")
    return {name: os.environ.get(name, "") for name in [*needed, "CORRAL_WORKDIR"]}


def _config(specs: list[str], settings: dict[str, str]) -> dict[str, Any]:
    """mini.yaml, the -c specs, then what the gateway dictates (endpoint, key, model name)."""
    from minisweagent.config import get_config_from_spec
    from minisweagent.utils.serialize import recursive_merge

    gateway = {
        "model": {
            "model_name": f"openai/{settings['CORRAL_MODEL']}",
            "model_kwargs": {
                "api_base": settings["OPENAI_BASE_URL"],
                "api_key": settings["OPENAI_API_KEY"],
                "max_retries": 0,  # the OpenAI client's own retries
            },
            "cost_tracking": "ignore_errors",  # no price for a model being trained
        }
    }
    return recursive_merge(*(get_config_from_spec(spec) for spec in ["mini.yaml", *specs]), gateway)


def _run(config: dict[str, Any], environment: str, settings: dict[str, str], output: str | None) -> int:
    from pathlib import Path

    import litellm
    import openai
    from minisweagent.agents import get_agent
    from minisweagent.models import get_model

    litellm.suppress_debug_info = True  # its help banners on every error

    env = _environment(environment, config.get("environment", {}), settings)
    try:
        agent_config = {**config.get("agent", {}), **({"output_path": Path(output)} if output else {})}
        agent = get_agent(get_model(config=config.get("model", {})), env, agent_config, default_type="default")
        try:
            result = agent.run(settings["CORRAL_TASK_PROMPT"])
        except openai.APIError as error:  # litellm's errors derive from the OpenAI client's
            if _gateway_code(error) in _LIMIT_CODES:
                print(f"minisweagent_harness: stopped by the gateway: {error}", file=sys.stderr)
                return 0
            print(f"minisweagent_harness: the model call failed: {error}", file=sys.stderr)
            return 1
    finally:
        getattr(env, "cleanup", lambda: None)()  # mini's LocalEnvironment has nothing to clean up
    print(f"minisweagent_harness: {result.get('exit_status', '')}", file=sys.stderr)
    return 0


def _environment(kind: str, options: dict[str, Any], settings: dict[str, str]) -> Any:
    workdir = {"cwd": settings["CORRAL_WORKDIR"]} if settings.get("CORRAL_WORKDIR") else {}
    if kind == "local":
        from minisweagent.environments.local import LocalEnvironment

        return LocalEnvironment(**{**options, **workdir})
    from corral.integrations.minisweagent import CorralEnvironment

    return CorralEnvironment(
        **{**options, **workdir}, address=settings["CORRAL_ADDRESS"], sandbox_id=settings["CORRAL_SANDBOX_ID"]
    )


def _gateway_code(error: Exception) -> str | None:
    """The `code` of the gateway's OpenAI-shaped error body, when litellm kept it."""
    body = getattr(error, "body", None)
    if isinstance(body, dict):
        detail = body.get("error", body)
        if isinstance(detail, dict) and isinstance(detail.get("code"), str):
            return detail["code"]
    code = getattr(error, "code", None)
    return code if isinstance(code, str) else None


if __name__ == "__main__":
    sys.exit(main())
