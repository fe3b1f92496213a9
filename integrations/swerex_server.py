"""SWE-ReX's HTTP protocol (its swerex/server.py) served by a CorralRuntime, so that SWE-ReX's
own RemoteRuntime and RemoteDeployment, and SWE-agent with `deployment: remote`, drive a corral
sandbox unchanged. `corral swerex-serve` runs it.

The protocol, as SWE-ReX's server speaks it: JSON bodies of SWE-ReX's request models on POST
/create_session, /run_in_session, /close_session, /execute, /read_file, /write_file, /close; GET
/is_alive and /; POST /upload as multipart form data (`file`, `target_path`, `unzip`: a zipped
directory); the token in the X-API-Key header (403 without it, 401 when wrong); an X-Request-ID header makes a
retried request get the answer of the first one; an exception of the runtime comes back as status
511 with {"swerexception": {message, class_path, traceback, extra_info}}, which RemoteRuntime
raises again as the same class; a body that is not a valid request: 422.
"""

from __future__ import annotations

import hmac
import logging
import tempfile
import traceback
import zipfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web
from pydantic import BaseModel, TypeAdapter, ValidationError
from swerex import __version__ as swerex_version
from swerex.runtime.abstract import (
    Action,
    CloseSessionRequest,
    Command,
    CreateSessionRequest,
    ReadFileRequest,
    UploadRequest,
    WriteFileRequest,
    _ExceptionTransfer,
)

from corral.integrations.swerex import CorralRuntime

log = logging.getLogger(__name__)

# SWE-ReX's status for "the runtime raised": RemoteRuntime re-raises what the body describes.
EXCEPTION_STATUS = 511
API_KEY_HEADER = "X-API-Key"
REQUEST_ID_HEADER = "X-Request-ID"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def make_app(runtime: CorralRuntime, auth_token: str) -> web.Application:
    """The server's aiohttp application; `auth_token` empty: no authentication, as SWE-ReX's
    server does with an empty token."""
    server = _Server(runtime)
    app = web.Application(
        middlewares=[_authenticate(auth_token), _remember_last_response(), _transfer_exceptions],
        client_max_size=1 << 30,  # uploads: SWE-agent sends whole repositories
    )
    app.router.add_get("/", server.root)
    app.router.add_get("/is_alive", server.is_alive)
    app.router.add_post("/create_session", server.json_call(TypeAdapter(CreateSessionRequest), runtime.create_session))
    app.router.add_post("/run_in_session", server.json_call(TypeAdapter(Action), runtime.run_in_session))
    app.router.add_post("/close_session", server.json_call(TypeAdapter(CloseSessionRequest), runtime.close_session))
    app.router.add_post("/execute", server.json_call(TypeAdapter(Command), runtime.execute))
    app.router.add_post("/read_file", server.json_call(TypeAdapter(ReadFileRequest), runtime.read_file))
    app.router.add_post("/write_file", server.json_call(TypeAdapter(WriteFileRequest), runtime.write_file))
    app.router.add_post("/upload", server.upload)
    app.router.add_post("/close", server.close)
    return app


class _Server:
    def __init__(self, runtime: CorralRuntime) -> None:
        self.runtime = runtime

    async def root(self, request: web.Request) -> web.Response:
        return web.json_response({"message": "hello world", "swerex_version": swerex_version})

    async def is_alive(self, request: web.Request) -> web.Response:
        return _model_response(await self.runtime.is_alive())

    def json_call(self, adapter: TypeAdapter, call: Callable[[Any], Awaitable[BaseModel]]) -> Handler:
        async def handle(request: web.Request) -> web.Response:
            try:
                parsed = adapter.validate_python(await request.json())
            except (ValidationError, ValueError) as error:
                return web.json_response({"detail": _validation_detail(error)}, status=422)
            return _model_response(await call(parsed))

        return handle

    async def upload(self, request: web.Request) -> web.Response:
        """The file arrives on this host first (zipped when it is a directory), then goes into the
        sandbox at exactly `target_path`."""
        form = await request.post()
        file, target_path = form.get("file"), form.get("target_path")
        if not isinstance(file, web.FileField) or not isinstance(target_path, str):
            return web.json_response({"detail": "upload needs the form fields file and target_path"}, status=422)
        unzip = str(form.get("unzip", "false")).lower() == "true"
        with tempfile.TemporaryDirectory(prefix="corral-swerex-upload-") as temp_dir:
            # Under the target's own name when it has one, so the runtime copies it in one step.
            name = Path(target_path).name
            source = Path(temp_dir) / (name if name not in ("", ".", "..") else "upload")
            if unzip:
                source.mkdir()
                with zipfile.ZipFile(file.file) as archive:
                    archive.extractall(source)  # zipfile drops absolute paths and ".." parts
            else:
                with open(source, "wb") as out:
                    while chunk := file.file.read(1 << 20):
                        out.write(chunk)
            return _model_response(
                await self.runtime.upload(UploadRequest(source_path=str(source), target_path=target_path))
            )

    async def close(self, request: web.Request) -> web.Response:
        return _model_response(await self.runtime.close())


def _authenticate(auth_token: str) -> Any:
    @web.middleware
    async def authenticate(request: web.Request, handler: Handler) -> web.StreamResponse:
        if auth_token:
            # As SWE-ReX's server answers: 403 without the header, 401 with a wrong token.
            given = request.headers.get(API_KEY_HEADER)
            if given is None:
                return web.json_response({"detail": "Not authenticated"}, status=403)
            if not hmac.compare_digest(given.encode(), auth_token.encode()):
                return web.json_response({"detail": "Invalid API Key"}, status=401)
        return await handler(request)

    return authenticate


def _remember_last_response() -> Any:
    """SWE-ReX's idempotency: the answer to the last X-Request-ID, given again to a retry of it."""
    last: dict[str, tuple[int, bytes, str]] = {}

    @web.middleware
    async def remember(request: web.Request, handler: Handler) -> web.StreamResponse:
        request_id = request.headers.get(REQUEST_ID_HEADER)
        if request_id and request_id in last:
            status, body, content_type = last[request_id]
            return web.Response(status=status, body=body, content_type=content_type)
        response = await handler(request)
        if request_id and isinstance(response, web.Response) and isinstance(response.body, bytes):
            last.clear()
            last[request_id] = (response.status, response.body, response.content_type)
        return response

    return remember


@web.middleware
async def _transfer_exceptions(request: web.Request, handler: Handler) -> web.StreamResponse:
    """An exception of the runtime as SWE-ReX's server sends it: status 511 with its class path,
    message, traceback and `extra_info`."""
    try:
        return await handler(request)
    except web.HTTPException:
        raise
    except Exception as error:  # noqa: BLE001 (any error of the runtime is the client's to see, as in SWE-ReX)
        transfer = _ExceptionTransfer(
            message=str(error),
            class_path=f"{type(error).__module__}.{type(error).__name__}",
            traceback=traceback.format_exc(),
            extra_info=getattr(error, "extra_info", {}) or {},
        )
        log.debug("%s %s raised %s", request.method, request.path, transfer.class_path)
        return web.json_response({"swerexception": transfer.model_dump()}, status=EXCEPTION_STATUS)


def _model_response(model: BaseModel) -> web.Response:
    return web.json_response(model.model_dump())


def _validation_detail(error: Exception) -> Any:
    if isinstance(error, ValidationError):
        return error.errors(include_url=False, include_context=False, include_input=False)
    return str(error)


async def serve(runtime: CorralRuntime, *, host: str, port: int, auth_token: str) -> web.AppRunner:
    """Starts serving in the running event loop and returns the runner (its `cleanup()` stops it);
    the bound address is `runner.addresses[0]`."""
    runner = web.AppRunner(make_app(runtime, auth_token), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner


__all__ = ["make_app", "serve"]
