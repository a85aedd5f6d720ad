"""The engine's OpenAI-compatible HTTP API (FastAPI + uvicorn).

``build_app(async_engine)`` makes the app; ``run_server(config, host, port)`` loads the model
and serves it. Routes raise; ``protocol.errors`` turns every error into OpenAI error JSON.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager, suppress
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from chatfleet.engine.api.async_engine import AsyncEngine
from chatfleet.engine.config import EngineConfig
from chatfleet.engine.api.memory_metrics import MemoryCollector
from chatfleet.engine.api.metrics import CONTENT_TYPE, RequestTimer, ServerMetrics
from chatfleet.engine.outputs import RequestOutput
from chatfleet.engine.request import SamplingParams
from chatfleet.engine.api.responders import (
    chat_response,
    chat_stream,
    completion_response,
    completion_stream,
    new_context,
)
from chatfleet.engine.api.serving import (
    chat_prompt_ids,
    template_tools,
    chat_sampling_params,
    completion_prompt,
    completion_sampling_params,
)
from chatfleet.errors import ChatfleetError, EngineDeadError, ModelNotFoundError
from chatfleet.protocol.errors import install_exception_handlers
from chatfleet.protocol.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    random_id,
)
from chatfleet.protocol.sse import MEDIA_TYPE

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class SSEResponse(StreamingResponse):
    """A streaming response that always closes its body and request (aborting it if unfinished)."""

    media_type = MEDIA_TYPE

    def __init__(self, content: AsyncIterator[bytes], outputs: RequestOutputs) -> None:
        super().__init__(content, headers=SSE_HEADERS)
        self.outputs = outputs

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            await self.outputs.aclose()


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def cancel_on_disconnect(request: Request, handler: Awaitable[Response]) -> Response:
    """Run ``handler``; if the client goes away first, cancel it (aborting its request)."""
    task = asyncio.ensure_future(handler)
    listener = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, listener):
            if not t.done():
                t.cancel()
        with suppress(asyncio.CancelledError):
            await listener
    if task.cancelled() or not task.done():
        with suppress(asyncio.CancelledError, Exception):
            await task
        return Response(status_code=499)
    return task.result()


class EngineUnavailableError(EngineDeadError):
    """The engine loop is not running: health checks get 503 so routers fail over."""

    status_code = 503


SESSION_HEADER = "x-session-id"  # what the gateway forwards (GatewayConfig.session_header)
MAX_SESSION_ID_CHARS = 256


def session_id_of(request: Request, user: str | None) -> str | None:
    """The conversation a request belongs to: the ``X-Session-ID`` header, else the OpenAI
    ``user`` field (eviction policies group KV blocks by it). Over-long ids are cut."""
    session = request.headers.get(SESSION_HEADER) or user
    return session[:MAX_SESSION_ID_CHARS] if session else None


class ServerState:
    """What the routes share: the engine, metrics and the names this server answers to."""

    def __init__(self, engine: AsyncEngine, model_aliases: tuple[str, ...] = ()) -> None:
        self.engine = engine
        self.model_name = engine.model_name
        self.names = {engine.model_name, *model_aliases}
        self.metrics = ServerMetrics(engine.model_name)
        if engine.memory is not None:  # the start-up memory breakdown, as gauges
            self.metrics.registry.register(MemoryCollector(engine.model_name, engine.memory))
        engine.on_first_scheduled = self.metrics.queue_time.observe
        self.open_requests = 0

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.names:
            raise ModelNotFoundError(
                f"model {model!r} is not served here; this server serves {self.model_name!r}",
                param="model",
            )

    async def start(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, cache_salt: str | None,
        session_id: str | None = None,
    ) -> RequestOutputs:
        """Submit a request and wait for its first output, so that admission errors are HTTP errors."""
        timer = RequestTimer(self.metrics)
        gen = self.engine.generate(request_id, prompt_ids, params, cache_salt=cache_salt, session_id=session_id)
        try:
            first = await anext(gen)
        except ChatfleetError as exc:
            self.metrics.request_rejected(exc.status_code)
            raise
        return RequestOutputs(self, first, gen, timer)


class RequestOutputs:
    """One request's outputs as an async iterator; ``aclose()`` (idempotent) aborts it if unfinished."""

    def __init__(self, state: ServerState, first: RequestOutput, gen: AsyncIterator[RequestOutput],
                 timer: RequestTimer) -> None:
        self._state = state
        self._first: RequestOutput | None = first
        self._gen = gen
        self._timer = timer
        self._closed = False
        state.open_requests += 1

    def __aiter__(self) -> RequestOutputs:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._first is not None:
            out, self._first = self._first, None
        else:
            out = await anext(self._gen)
        self._timer.on_output(out)
        return out

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            self._state.open_requests -= 1
            await self._gen.aclose()


def build_app(engine: AsyncEngine, *, model_aliases: tuple[str, ...] = (), start_engine: bool = True) -> FastAPI:
    """The HTTP app over ``engine``; the engine thread starts and stops with the app."""
    state = ServerState(engine, model_aliases)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if start_engine:
            engine.start()
        try:
            yield
        finally:
            if start_engine:
                await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="chatfleet engine", lifespan=lifespan)
    app.state.chatfleet = state
    install_exception_handlers(app)
    tok = engine.tokenizer

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        async def handle() -> Response:
            state.check_model(body.model)
            prompt_ids = chat_prompt_ids(tok, body.messages, body.add_generation_prompt, template_tools(body))
            params = chat_sampling_params(body, len(prompt_ids), engine.max_request_tokens)
            ctx = new_context(random_id("chatcmpl"), state.model_name, tok)
            outputs = await state.start(ctx.request_id, prompt_ids, params, body.cache_salt,
                                        session_id_of(request, body.user))
            if body.stream:
                return SSEResponse(chat_stream(ctx, body, outputs), outputs)
            return JSONResponse((await chat_response(ctx, body, outputs)).model_dump())

        return await cancel_on_disconnect(request, handle())

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        async def handle() -> Response:
            state.check_model(body.model)
            prompt = completion_prompt(tok, body)
            params = completion_sampling_params(body, len(prompt.token_ids), engine.max_request_tokens)
            ctx = new_context(random_id("cmpl"), state.model_name, tok)
            outputs = await state.start(ctx.request_id, prompt.token_ids, params, body.cache_salt,
                                        session_id_of(request, body.user))
            if body.stream:
                return SSEResponse(completion_stream(ctx, body, prompt, outputs), outputs)
            return JSONResponse((await completion_response(ctx, body, prompt, outputs)).model_dump())

        return await cancel_on_disconnect(request, handle())

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = ModelCard(id=state.model_name, root=state.model_name, max_model_len=engine.max_model_len,
                         kv_cache_tokens=engine.kv_cache_tokens)
        return ModelList(data=[card]).model_dump()

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_alive:
            raise EngineUnavailableError(f"the engine loop is not running ({engine.dead_error!r})")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        stats = await engine.stats() if engine.is_alive else None
        body = state.metrics.render(stats, alive=engine.is_alive, open_requests=state.open_requests)
        return Response(body, media_type=CONTENT_TYPE)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict[str, Any]:
        empty = bool(await engine.reset_prefix_cache())
        state.metrics.prefix_cache_reset(empty)
        return {"success": empty, "prefix_cache_empty": empty}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        state.check_model(body.model)
        if body.messages is not None:
            tokens = chat_prompt_ids(tok, body.messages, body.add_generation_prompt)
        else:
            tokens = tok.encode(body.prompt)
        return TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=engine.max_model_len).model_dump()

    return app


def build_engine(config: EngineConfig, **kw: Any) -> AsyncEngine:
    """Load the model and wrap the Engine for serving."""
    from chatfleet.engine.engine import Engine

    return AsyncEngine(Engine(config), **kw)


def run_server(config: EngineConfig, host: str = "127.0.0.1", port: int = 8000, *,
               log_level: str = "info") -> None:
    """Load the model, then serve it until interrupted (SIGINT/SIGTERM shut down cleanly)."""
    engine = build_engine(config)
    aliases = tuple(a for a in (config.model,) if a != engine.model_name)
    app = build_app(engine, model_aliases=aliases)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
