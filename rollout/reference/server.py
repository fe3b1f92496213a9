"""The built-in reference LLM server: SGLang's native HTTP protocol in front of a built-in policy
(`replay.ReplayPolicy` or `tiny.TinyPolicy`), so that the rollout pipeline, the clients and the
trainer adapters run end to end without a GPU.

Endpoints (the subset of SGLang's that the daemon and trainers use):
- POST /generate: {"input_ids": [...] (or "text"), "sampling_params": {...}, "return_logprob":
  bool} -> {"text", "output_ids", "meta_info": {"id", "finish_reason": {"type": "stop",
  "matched": id-or-string} | {"type": "length", "length": n}, "prompt_tokens",
  "completion_tokens", "cached_tokens", "weight_version" (a string of an int), "e2e_latency",
  "output_token_logprobs": [[logprob, id, null], ...] (with return_logprob)}}. `output_ids`
  always keeps the stop token (as SGLang's do); `text` drops special tokens unless
  skip_special_tokens is false and trims the matched stop unless no_stop_trim is true.
  With "stream": true, server-sent events as SGLang sends them, one per generated token: `data:
  {"text", "output_ids", "meta_info"}` with everything so far (SGLang's default) or, with
  `incremental_streaming_output` (--incremental-streaming-output), only what is new;
  meta_info.completion_tokens is the count so far and finish_reason is null until the last
  event; then `data: [DONE]`.
- GET /health, /health_generate: 200.
- GET /get_model_info, /get_weight_version.
- POST /update_weights_from_disk {"model_path", "weight_version"?}: {"success", "message",
  "num_paused_requests"}; 400 when the policy has no weights (replay) or the file is unusable.
Errors are 400 {"error": {"message": ...}}.

Optional simulated latency (`latency_s` + `per_token_latency_s` per generated token, slept
without blocking) lets benchmarks model a real server's timing; streamed, `latency_s` comes before
the first token and `per_token_latency_s` before each.

Command line:
    python -m corral.rollout.reference.server --policy replay --tasks FILE.jsonl --port N
        [--submit-command 'echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT']   (a bash-only harness's calls)
        [--vocabulary NAME [--workdir DIR]]   (a harness's own tools: a coding CLI's)
    python -m corral.rollout.reference.server --policy tiny [--checkpoint PATH] --port N
It prints the base URL on one line once it listens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import threading
import time
import uuid
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from aiohttp import web
from google.protobuf import json_format

from corral.rollout.reference.policies import GenerateParams, Policy, PolicyError, PolicyOutput
from corral.rollout.tokenizer import ByteChatTokenizer
from corral.v1 import rollout_pb2 as pb


class ReferenceServer:
    """An aiohttp server speaking SGLang's protocol for one policy.

    Async callers: `url = await server.start()` ... `await server.stop()`. Sync callers (tests,
    trainer scripts): `url = server.start_in_thread()` ... `server.stop_in_thread()`; the server
    then runs its own event loop in a daemon thread.
    """

    def __init__(
        self,
        policy: Policy,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        latency_s: float = 0.0,
        per_token_latency_s: float = 0.0,
        model_path: str | None = None,
        grace_s: float = 1.0,
        incremental_streaming_output: bool = False,
    ) -> None:
        self.policy = policy
        self.incremental_streaming_output = incremental_streaming_output
        self.host = host
        self.port = port
        self.latency_s = latency_s
        self.per_token_latency_s = per_token_latency_s
        self.model_path = model_path or f"builtin:{policy.name}"
        # How long stop() lets requests in flight finish before dropping their connections (a
        # tiny value simulates a server that dies).
        self.grace_s = max(grace_s, 0.001)
        self.tokenizer = ByteChatTokenizer()
        # Generate requests answered (200) since start, for tests and benchmarks.
        self.requests_served = 0
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/generate", self._generate)
        app.router.add_get("/health", self._health)
        app.router.add_get("/health_generate", self._health)
        app.router.add_get("/get_model_info", self._model_info)
        app.router.add_get("/get_weight_version", self._weight_version)
        app.router.add_post("/update_weights_from_disk", self._update_weights)
        return app

    async def start(self) -> str:
        """Listens (on a free port when port is 0) and returns the base URL."""
        if self._runner is not None:
            raise RuntimeError("the server is already running")
        runner = web.AppRunner(self.app(), access_log=None, shutdown_timeout=self.grace_s)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port)
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self.port = runner.addresses[0][1]
        self._runner = runner
        return self.url

    async def stop(self) -> None:
        """Stops listening; requests in flight get `grace_s` to finish, then their connections are
        dropped (they fail on the client)."""
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    def start_in_thread(self) -> str:
        """Runs the server on its own event loop in a daemon thread; returns the base URL."""
        if self._thread is not None:
            raise RuntimeError("the server is already running in a thread")
        started: Future[str] = Future()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            try:
                started.set_result(loop.run_until_complete(self.start()))
            except BaseException as error:  # noqa: BLE001 - handed to the caller
                started.set_exception(error)
                loop.close()
                return
            loop.run_forever()
            loop.run_until_complete(self.stop())
            loop.close()

        self._thread = threading.Thread(target=run, name=f"reference-server-{self.policy.name}", daemon=True)
        self._thread.start()
        try:
            return started.result(timeout=30)
        except BaseException:
            self._thread.join(timeout=5)
            self._thread = None
            raise

    def stop_in_thread(self) -> None:
        thread, loop = self._thread, self._loop
        if thread is None or loop is None:
            return
        asyncio.run_coroutine_threadsafe(self.stop(), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        self._thread = self._loop = None

    # ---- handlers ------------------------------------------------------------------------------

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        started = time.monotonic()
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error("the body is not JSON")
        if not isinstance(body, dict):
            return _error("the body must be a JSON object")
        try:
            input_ids = self._input_ids(body)
            params = GenerateParams.from_sglang(body.get("sampling_params"))
            output = await self.policy.generate(input_ids, params)
        except PolicyError as error:
            return _error(str(error))
        if body.get("stream"):
            return await self._stream(request, body, input_ids, output, started)
        if self.latency_s or self.per_token_latency_s:
            await asyncio.sleep(self.latency_s + self.per_token_latency_s * len(output.output_ids))
        self.requests_served += 1
        return web.json_response(self._answer(body, input_ids, output, len(output.output_ids), started))

    def _answer(
        self, body: dict[str, Any], input_ids: list[int], output: PolicyOutput, count: int, started: float
    ) -> dict[str, Any]:
        """The answer for the first `count` generated ids (all of them: the whole answer, with its
        finish reason)."""
        done = count == len(output.output_ids)
        version = self.policy.weight_version if output.weight_version is None else output.weight_version
        params_raw = body.get("sampling_params") or {}
        meta: dict[str, Any] = {
            "id": uuid.uuid4().hex,
            "finish_reason": _finish_reason(output) if done else None,
            "prompt_tokens": len(input_ids),
            "completion_tokens": count,
            "cached_tokens": 0,
            "weight_version": str(version),
            "e2e_latency": time.monotonic() - started,
        }
        ids = output.output_ids[:count]
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [[lp, token, None] for lp, token in zip(output.logprobs, ids)]
        partial = output if done else PolicyOutput(ids, output.logprobs[:count], "length", None, output.weight_version)
        text = self._text(
            partial,
            skip_special=params_raw.get("skip_special_tokens", True),
            no_stop_trim=bool(params_raw.get("no_stop_trim", False)),
        )
        return {"text": text, "output_ids": ids, "meta_info": meta}

    async def _stream(
        self, request: web.Request, body: dict[str, Any], input_ids: list[int], output: PolicyOutput, started: float
    ) -> web.StreamResponse:
        """One event per generated token (an event with the finish reason alone when there is
        none); a client that goes away ends it."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        await asyncio.sleep(self.latency_s)
        sent_ids, sent_text = 0, ""
        try:
            for count in range(1, len(output.output_ids) + 1) or [0]:
                await asyncio.sleep(self.per_token_latency_s if count else 0.0)
                answer = self._answer(body, input_ids, output, count, started)
                if self.incremental_streaming_output:
                    text = answer["text"]
                    answer["text"] = text[len(sent_text) :] if text.startswith(sent_text) else text
                    answer["output_ids"] = answer["output_ids"][sent_ids:]
                    meta = answer["meta_info"]
                    if "output_token_logprobs" in meta:
                        meta["output_token_logprobs"] = meta["output_token_logprobs"][sent_ids:]
                    sent_ids, sent_text = count, text
                await response.write(b"data: " + json.dumps(answer).encode() + b"\n\n")
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except ConnectionError:  # the client went away: the request is dropped
            return response
        self.requests_served += 1
        return response

    def _input_ids(self, body: dict[str, Any]) -> list[int]:
        ids = body.get("input_ids")
        if ids is None:
            text = body.get("text")
            if not isinstance(text, str):
                raise PolicyError("give input_ids (a list of ints) or text (a string); batches are not supported")
            return self.tokenizer.encode(text)
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise PolicyError("input_ids must be one list of ints (batches are not supported)")
        vocab = self.tokenizer.vocab_size
        if not ids or any(not 0 <= i < vocab for i in ids):
            raise PolicyError(f"input_ids must be a non-empty list of ids in [0, {vocab})")
        return ids

    def _text(self, output: PolicyOutput, *, skip_special: bool, no_stop_trim: bool) -> str:
        ids = output.output_ids
        if not no_stop_trim and isinstance(output.matched, int) and ids and ids[-1] == output.matched:
            ids = ids[:-1]
        if skip_special:
            ids = [i for i in ids if i < ByteChatTokenizer.BYTE_COUNT]
        text = self.tokenizer.decode(ids)
        if not no_stop_trim and isinstance(output.matched, str):
            position = text.find(output.matched)
            text = text[:position] if position >= 0 else text
        return text

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def _model_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": self.model_path,
                "tokenizer_path": "builtin:bytes",
                "is_generation": True,
                "weight_version": str(self.policy.weight_version),
                "vocab_size": self.tokenizer.vocab_size,
                "policy": self.policy.name,
            }
        )

    async def _weight_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": str(self.policy.weight_version)})

    async def _update_weights(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            body = None
        if not isinstance(body, dict) or not isinstance(body.get("model_path"), str):
            return _update_result(False, 'the body must be {"model_path": "...", "weight_version": "..."}')
        raw_version = body.get("weight_version")
        try:
            version = None if raw_version in (None, "") else int(raw_version)
        except (TypeError, ValueError):
            return _update_result(False, f"weight_version must be an integer, not {raw_version!r}")
        try:
            new_version = await self.policy.load_weights(body["model_path"], version)
        except PolicyError as error:
            return _update_result(False, str(error))
        return _update_result(True, f"loaded {body['model_path']}; weight version {new_version}")


def _finish_reason(output: PolicyOutput) -> dict[str, Any]:
    if output.finish_reason == "length":
        return {"type": "length", "length": len(output.output_ids)}
    reason: dict[str, Any] = {"type": output.finish_reason}
    if output.matched is not None:
        reason["matched"] = output.matched
    return reason


def _error(message: str, status: int = 400) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


def _update_result(success: bool, message: str) -> web.Response:
    return web.json_response(
        {"success": success, "message": message, "num_paused_requests": 0}, status=200 if success else 400
    )


# ---- command line -------------------------------------------------------------------------------


def load_tasks_jsonl(path: str | Path) -> list[pb.Task]:
    """Tasks from a JSONL file, one Task per line in the proto3 JSON mapping."""
    tasks = []
    with open(path, encoding="utf-8") as file:
        for number, line in enumerate(file, 1):
            if not line.strip():
                continue
            try:
                tasks.append(json_format.Parse(line, pb.Task()))
            except json_format.ParseError as error:
                raise ValueError(f"{path}:{number}: {error}") from None
    return tasks


def make_policy(
    kind: str,
    *,
    tasks: str | None = None,
    checkpoint: str | None = None,
    seed: int = 0,
    submit_command: str | None = None,
    vocabulary: str | None = None,
    workdir: str = "/workspace",
) -> Policy:
    if kind == "replay":
        from corral.rollout.reference.replay import ReplayPolicy
        from corral.rollout.reference.vocabularies import vocabulary as load_vocabulary

        if not tasks:
            raise ValueError("--policy replay needs --tasks FILE.jsonl")
        return ReplayPolicy(
            load_tasks_jsonl(tasks),
            submit_command=submit_command,
            vocabulary=load_vocabulary(vocabulary) if vocabulary else None,
            workdir=workdir,
        )
    if submit_command is not None or vocabulary is not None:
        raise ValueError("--submit-command and --vocabulary are options of the replay policy")
    if kind == "tiny":
        from corral.rollout.reference.tiny import TinyPolicy

        return TinyPolicy(seed=seed, checkpoint=checkpoint)
    raise ValueError(f"unknown policy {kind!r} (replay or tiny)")


async def _serve(server: ReferenceServer) -> None:
    url = await server.start()
    print(url, flush=True)
    stopped = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stopped.set)
    try:
        await stopped.wait()
    finally:
        await server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m corral.rollout.reference.server",
        description="The built-in reference LLM server (SGLang protocol).",
    )
    parser.add_argument("--policy", choices=("replay", "tiny"), required=True)
    parser.add_argument("--tasks", help="JSONL tasks whose reference solutions the replay policy plays")
    parser.add_argument(
        "--submit-command",
        help="replay: answer as a harness whose only tool is bash (mini-swe-agent): editor calls as bash "
        "commands, the submit call as a bash call running this command",
    )
    parser.add_argument(
        "--vocabulary",
        help="replay: answer in this harness's own tools (rollout/reference/vocabularies: a coding CLI's)",
    )
    parser.add_argument(
        "--workdir", default="/workspace", help="replay with --vocabulary: the directory the harness runs in"
    )
    parser.add_argument("--checkpoint", help="a torch.save'd TinyByteLM state dict for the tiny policy")
    parser.add_argument("--seed", type=int, default=0, help="the tiny policy's initial weights and sampling seed")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000, help="0: a free port (the URL is printed)")
    parser.add_argument("--latency-s", type=float, default=0.0, help="simulated fixed latency per request")
    parser.add_argument("--per-token-latency-s", type=float, default=0.0, help="simulated latency per generated token")
    parser.add_argument(
        "--incremental-streaming-output",
        action="store_true",
        help="streamed events carry only the new ids and logprobs (SGLang's option of that name)",
    )
    args = parser.parse_args(argv)
    try:
        policy = make_policy(
            args.policy,
            tasks=args.tasks,
            checkpoint=args.checkpoint,
            seed=args.seed,
            submit_command=args.submit_command,
            vocabulary=args.vocabulary,
            workdir=args.workdir,
        )
    except (OSError, ValueError, PolicyError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    server = ReferenceServer(
        policy,
        args.host,
        args.port,
        latency_s=args.latency_s,
        per_token_latency_s=args.per_token_latency_s,
        incremental_streaming_output=args.incremental_streaming_output,
    )
    asyncio.run(_serve(server))
    return 0


if __name__ == "__main__":
    sys.exit(main())
