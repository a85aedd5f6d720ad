"""The engine's OpenAI-compatible HTTP API (FastAPI + uvicorn).

``build_app(async_engine, options=ServerOptions())`` makes the app; ``run_server(config, host,
port)`` loads the model and serves it. Routes raise; ``protocol.errors`` turns every error into
OpenAI error JSON. Bodies over the limit get 413 before they are parsed, JSON goes through
``protocol.safe_json``, prompts are rendered and tokenized off the event loop
(``engine/api/prompts.py``), and each request runs under the ``--request-timeout`` deadline.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from chatfleet.engine.api.async_engine import AsyncEngine
from chatfleet.engine.api.auth import Authenticator, Tenant
from chatfleet.engine.api.dead_engine_exit import DeadEngineWatch
from chatfleet.engine.api.engine_client import EngineClient
from chatfleet.engine.api.fanout import interleave, merge_responses, plan_choices, start_choices
from chatfleet.engine.api.metrics import CONTENT_TYPE
from chatfleet.engine.api.openapi import ERROR_RESPONSES, GENERATION_RESPONSES, install_openapi
from chatfleet.engine.api.options import ServerOptions
from chatfleet.engine.api.prompts import PromptBuilder
from chatfleet.engine.api.requests import (
    Deadline,
    RequestOutputs,
    ServerState,
    SSEResponse,
    cancel_on_disconnect,
)
from chatfleet.engine.api.responders import (
    StreamPart,
    chat_response,
    chat_stream,
    chat_usage_chunk,
    completion_response,
    completion_stream,
    completion_usage_chunk,
    new_context,
)
from chatfleet.engine.api.serving import (
    chat_sampling_params,
    check_token_ids,
    completion_sampling_params,
    template_tools,
)
from chatfleet.engine.api.structured_output import compile_grammar, request_grammar
from chatfleet.engine.config import EngineConfig
from chatfleet.errors import EngineDeadError, NotFoundError
from chatfleet.protocol.body_limit import BodyLimitMiddleware
from chatfleet.protocol.errors import error_response, install_exception_handlers
from chatfleet.protocol.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    random_id,
)
from chatfleet.protocol.safe_json import LARGE_BODY_PARSER, SafeJSONRoute
from chatfleet.protocol.startup_gc import freeze_startup_objects
from chatfleet.protocol.switch_interval import shorten_switch_interval

__all__ = ["build_app", "build_engine", "run_server", "RequestOutputs", "ServerState", "SSEResponse"]


class EngineUnavailableError(EngineDeadError):
    """The engine loop is not running: health checks get 503 so routers fail over."""

    status_code = 503


SESSION_HEADER = "x-session-id"  # what the gateway forwards (GatewayConfig.session_header)
MAX_SESSION_ID_CHARS = 256
OPEN_PATHS = frozenset({"/health", "/metrics"})  # answered without an API key (probes, scrapers)
ADMIN_PATHS = frozenset({"/reset_prefix_cache"})


def session_id_of(request: Request, user: str | None) -> str | None:
    """The conversation a request belongs to: the ``X-Session-ID`` header, else the OpenAI
    ``user`` field (eviction policies group KV blocks by it). Over-long ids are cut."""
    session = request.headers.get(SESSION_HEADER) or user
    return session[:MAX_SESSION_ID_CHARS] if session else None


class AuthMiddleware:
    """Every route but ``OPEN_PATHS`` needs a key (when keys are set); the tenant goes in ``request.state``."""

    def __init__(self, app: Any, auth: Authenticator) -> None:
        self.app = app
        self.auth = auth

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            if scope["path"] not in OPEN_PATHS:
                try:
                    tenant = self.auth.check(Request(scope))
                except Exception as exc:  # noqa: BLE001 - AuthenticationError, answered as 401
                    await error_response(exc)(scope, receive, send)
                    return
                scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)


def tenant_of(request: Request) -> Tenant:
    return request.state.tenant


def build_app(engine: EngineClient, *, model_aliases: tuple[str, ...] = (), start_engine: bool = True,
              options: ServerOptions | None = None) -> FastAPI:
    """The HTTP app over ``engine``; the engine thread starts and stops with the app."""
    options = options or ServerOptions()
    state = ServerState(engine, model_aliases)
    prompts = PromptBuilder(engine.tokenizer, engine.max_model_len, workers=options.tokenizer_workers)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        prompts.start()
        if start_engine:
            engine.start()
        try:
            yield
        finally:
            prompts.close()
            if start_engine:
                await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="chatfleet engine", lifespan=lifespan)
    app.router.route_class = SafeJSONRoute
    if prompts.judges_bodies:  # large bodies parsed and measured off the step loop's interpreter
        setattr(app.state, LARGE_BODY_PARSER, prompts.parse_body)
    app.state.chatfleet = state
    install_exception_handlers(app)
    install_openapi(app, engine.tokenizer.vocab_size, engine.max_model_len)
    app.add_middleware(AuthMiddleware, auth=Authenticator(options.api_keys, salt_per_key=options.salt_cache_per_key))
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=options.max_body_bytes)
    tok = engine.tokenizer

    @app.post("/v1/chat/completions", responses=GENERATION_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        async def handle() -> Response:
            deadline = Deadline(options.request_timeout_s)
            state.check_model(body.model)
            ctx = new_context(random_id("chatcmpl"), state.model_name, tok)
            grammar = request_grammar(body, ctx.tool_parser)
            prompt_ids = await deadline.run(prompts.chat(body.messages, body.add_generation_prompt,
                                                         template_tools(body)))
            await deadline.run(compile_grammar(engine.grammar_compiler, grammar))
            params = check_token_ids(chat_sampling_params(body, len(prompt_ids), engine.max_request_tokens,
                                                          grammar), tok.vocab_size)
            salt, session = tenant_of(request).salt(body.cache_salt), session_id_of(request, body.user)
            if body.n > 1:
                choices = plan_choices([(prompt_ids, params)], body.n)
                all_outputs = await start_choices(state, ctx.request_id, choices, salt, session, deadline)
                if body.stream:
                    parts = [StreamPart(c.index) for c in choices]
                    usage = partial(chat_usage_chunk, ctx) if body.include_usage else None
                    streams = [chat_stream(ctx, body, o, p) for o, p in zip(all_outputs, parts, strict=True)]
                    return SSEResponse(interleave(streams, parts, choices, usage), all_outputs)
                responses = await asyncio.gather(*(chat_response(ctx, body, o) for o in all_outputs))
                return JSONResponse(merge_responses(list(responses), choices).model_dump())
            outputs = await state.start(ctx.request_id, prompt_ids, params, salt, session, deadline)
            if body.stream:
                return SSEResponse(chat_stream(ctx, body, outputs), outputs)
            return JSONResponse((await chat_response(ctx, body, outputs)).model_dump())

        return await cancel_on_disconnect(request, handle())

    @app.post("/v1/completions", responses=GENERATION_RESPONSES)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        async def handle() -> Response:
            deadline = Deadline(options.request_timeout_s)
            state.check_model(body.model)
            salt, session = tenant_of(request).salt(body.cache_salt), session_id_of(request, body.user)
            ctx = new_context(random_id("cmpl"), state.model_name, tok)
            grammar = request_grammar(body, ctx.tool_parser)
            await deadline.run(compile_grammar(engine.grammar_compiler, grammar))
            if len(body.prompts) == 1 and body.n == 1:
                prompt = await deadline.run(prompts.completion(body.prompts[0]))
                params = check_token_ids(completion_sampling_params(
                    body, len(prompt.token_ids), engine.max_request_tokens, grammar), tok.vocab_size)
                outputs = await state.start(ctx.request_id, prompt.token_ids, params, salt, session, deadline)
                if body.stream:
                    return SSEResponse(completion_stream(ctx, body, prompt, outputs), outputs)
                return JSONResponse((await completion_response(ctx, body, prompt, outputs)).model_dump())
            built = await deadline.run(asyncio.gather(*(prompts.completion(p) for p in body.prompts)))
            choices = plan_choices([(p.token_ids, check_token_ids(completion_sampling_params(
                body, len(p.token_ids), engine.max_request_tokens, grammar), tok.vocab_size)) for p in built], body.n)
            all_outputs = await start_choices(state, ctx.request_id, choices, salt, session, deadline)
            if body.stream:
                parts = [StreamPart(c.index) for c in choices]
                usage = partial(completion_usage_chunk, ctx) if body.include_usage else None
                streams = [completion_stream(ctx, body, built[c.prompt_index], o, p)
                           for c, o, p in zip(choices, all_outputs, parts, strict=True)]
                return SSEResponse(interleave(streams, parts, choices, usage), all_outputs)
            responses = await asyncio.gather(*(completion_response(ctx, body, built[c.prompt_index], o)
                                               for c, o in zip(choices, all_outputs, strict=True)))
            return JSONResponse(merge_responses(list(responses), choices).model_dump())

        return await cancel_on_disconnect(request, handle())

    def model_card() -> ModelCard:
        return ModelCard(id=state.model_name, root=state.model_name, max_model_len=engine.max_model_len,
                         kv_cache_tokens=engine.kv_cache_tokens)

    @app.get("/v1/models", responses=ERROR_RESPONSES)
    async def models() -> dict[str, Any]:
        return ModelList(data=[model_card()]).model_dump()

    @app.get("/v1/models/{model_id:path}", responses=ERROR_RESPONSES)
    async def model(model_id: str) -> dict[str, Any]:
        state.check_model(model_id)
        return model_card().model_dump()

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_alive:
            raise EngineUnavailableError("the engine loop is not running; the server log has the cause")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        stats = await engine.stats() if engine.is_alive else None
        body = state.metrics.render(stats, alive=engine.is_alive, open_requests=state.open_requests)
        return Response(body, media_type=CONTENT_TYPE)

    @app.post("/reset_prefix_cache", responses=ERROR_RESPONSES)
    async def reset_prefix_cache() -> dict[str, Any]:
        if not options.enable_admin_api:
            raise NotFoundError("/reset_prefix_cache is an admin route; start the engine with --enable-admin-api")
        empty = bool(await engine.reset_prefix_cache())
        state.metrics.prefix_cache_reset(empty)
        return {"success": empty, "prefix_cache_empty": empty}

    @app.post("/tokenize", responses=ERROR_RESPONSES)
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        state.check_model(body.model)
        deadline = Deadline(options.request_timeout_s)
        if body.messages is not None:
            tokens = await deadline.run(prompts.chat(body.messages, body.add_generation_prompt))
        else:
            assert body.prompt is not None  # the request model holds exactly one of the two
            tokens = await deadline.run(prompts.encode(body.prompt))
        return TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=engine.max_model_len).model_dump()

    return app


def build_engine(config: EngineConfig, **kw: Any) -> AsyncEngine:
    """Load the model and wrap the Engine for serving."""
    from chatfleet.engine.engine import Engine

    return AsyncEngine(Engine(config), **kw)


def run_server(config: EngineConfig, host: str = "127.0.0.1", port: int = 8000, *,
               log_level: str = "info", options: ServerOptions | None = None) -> None:
    """Load the model, then serve it until interrupted (SIGINT/SIGTERM shut down cleanly). With
    ``options.engine_process`` (the default) the engine core runs in a process of its own. If the
    engine dies, the server stops a moment later and exits with status 1 (``dead_engine_exit``)."""
    options = options or ServerOptions()
    engine: EngineClient
    if options.engine_process:
        from chatfleet.engine.api.engine_process import EngineProcess

        engine = EngineProcess(config, log_level=log_level)
    else:
        engine = build_engine(config)
    aliases = tuple(a for a in (config.model,) if a != engine.model_name)
    app = build_app(engine, model_aliases=aliases, options=options)
    shorten_switch_interval()  # the step loop's thread gets the GIL back soon behind a busy event loop
    freeze_startup_objects()  # the model and the app: no full GC pass walks them again (~210 ms each)
    if serve_until_stopped(app, engine=engine, host=host, port=port, log_level=log_level):
        raise SystemExit(1)  # the engine died: exit so that a supervisor starts a new server


def serve_until_stopped(app: FastAPI, *, engine: EngineClient, host: str, port: int, log_level: str) -> bool:
    """Serve ``app`` with uvicorn until SIGINT/SIGTERM, or until the engine died (then True)."""
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                           timeout_graceful_shutdown=5))
    watch = DeadEngineWatch(engine, stop=partial(setattr, server, "should_exit", True)).start()
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it shut down on; as uvicorn.run: a clean exit
        pass
    finally:
        watch.close()
    return watch.fired
