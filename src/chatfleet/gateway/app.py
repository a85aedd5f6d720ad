"""The gateway's HTTP front: an OpenAI-compatible API over a set of replicas.

Routes: ``POST /v1/chat/completions`` and ``/v1/completions`` (validated here, then proxied),
``GET /v1/models`` (models of the healthy replicas), ``GET /v1/models/{id}`` and ``POST
/tokenize`` (passed through to one replica), ``POST /reset_prefix_cache`` (admin: every
replica, see ``fleet_ops.py``), ``GET /health`` (200 while some replica is healthy), ``GET
/metrics`` (the gateway's own series, and where the replicas' are), ``GET /gateway/status``
(replica states as JSON), ``GET /gateway/targets`` (the replicas as Prometheus HTTP service
discovery) and ``GET /openapi.json`` (see ``openapi.py``).
The gateway's state and request handling live in ``service.py``.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, cast

import uvicorn
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from chatfleet.errors import NoHealthyReplicaError, UpstreamError
from chatfleet.gateway.config import GatewayConfig
from chatfleet.gateway.discovery import Discovery
from chatfleet.gateway.fleet_ops import forward, pass_through_replica, reset_fleet, scrape_note, scrape_targets
from chatfleet.gateway.jsonlog import configure_json_logging
from chatfleet.gateway.metrics import CONTENT_TYPE
from chatfleet.gateway.openapi import gateway_openapi
from chatfleet.gateway.service import ENDPOINTS, Gateway
from chatfleet.protocol.errors import install_exception_handlers
from chatfleet.protocol.startup_gc import freeze_startup_objects
from chatfleet.protocol.switch_interval import shorten_switch_interval

if TYPE_CHECKING:
    from chatfleet.gateway.supervisor import ProcessState

__all__ = ["Gateway", "create_app", "run_gateway"]


def create_app(config: GatewayConfig,
               processes: Callable[[], Mapping[str, ProcessState]] | None = None,
               discovery: Discovery | None = None) -> FastAPI:
    """The gateway app; ``processes`` reports the replica processes `serve` supervises;
    ``discovery`` replaces the one ``config.replicas_from`` names (tests: a resolver of their own)."""
    gateway = Gateway(config, processes, discovery)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await gateway.start()
        try:
            yield
        finally:
            await gateway.stop()

    app = FastAPI(title="chatfleet gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.openapi = lambda: app.openapi_schema or _set_schema(app)  # type: ignore[method-assign]  # FastAPI's way
    app.state.gateway = gateway
    install_exception_handlers(app)

    # A ProxyResponse is an ASGI response that Starlette calls as it calls a Response (not a subclass).
    proxy = cast(Callable[[Request], Awaitable[Response]], gateway.proxy)
    for path in ENDPOINTS:
        app.router.add_route(path, proxy, methods=["POST"])

    async def models(request: Request) -> JSONResponse:
        gateway.check_auth(request)
        return JSONResponse({"object": "list", "data": gateway.replicas.models()})

    async def health(request: Request) -> JSONResponse:
        healthy = gateway.replicas.healthy()
        if not healthy:
            raise NoHealthyReplicaError("no healthy replica")
        return JSONResponse({"status": "ok", "healthy_replicas": len(healthy),
                             "replicas": len(gateway.replicas.urls)})

    async def metrics(request: Request) -> Response:
        return Response(gateway.metrics.render() + scrape_note(gateway), media_type=CONTENT_TYPE)

    async def targets(request: Request) -> JSONResponse:
        gateway.check_auth(request)
        return JSONResponse(scrape_targets(gateway))

    async def reset(request: Request) -> JSONResponse:
        gateway.check_admin(request)
        report = await reset_fleet(gateway)
        return JSONResponse(report.to_dict(), status_code=200 if report.success else 502)

    async def passed_through(request: Request, model: str | None) -> Response:
        gateway.check_auth(request)
        body = await gateway.read_body(request) if request.method == "POST" else None
        url = pass_through_replica(gateway, model)
        if url is None:
            raise NoHealthyReplicaError("no healthy replica is available; retry later")
        headers = gateway.upstream_headers(request, request.headers.get(config.request_id_header) or uuid.uuid4().hex)
        answer = await forward(gateway, url, request.method, request.url.path, body, headers)
        if answer is None:
            raise UpstreamError(f"the replica for {request.url.path} did not answer; retry later")
        return Response(answer.body, status_code=answer.status, media_type=answer.content_type,
                        headers={config.replica_header: url})

    async def model(request: Request) -> Response:
        return await passed_through(request, request.path_params["model"])

    async def tokenize(request: Request) -> Response:
        return await passed_through(request, None)

    async def status(request: Request) -> JSONResponse:
        gateway.check_auth(request)
        return JSONResponse(gateway.status())

    app.router.add_route("/v1/models", models, methods=["GET"])
    app.router.add_route("/health", health, methods=["GET"])
    app.router.add_route("/metrics", metrics, methods=["GET"])
    app.router.add_route("/gateway/status", status, methods=["GET"])
    app.router.add_route("/gateway/targets", targets, methods=["GET"])
    app.router.add_route("/reset_prefix_cache", reset, methods=["POST"])
    app.router.add_route("/v1/models/{model:path}", model, methods=["GET"])
    app.router.add_route("/tokenize", tokenize, methods=["POST"])
    return app


def _set_schema(app: FastAPI) -> dict[str, Any]:
    app.openapi_schema = gateway_openapi(app.title, app.version)
    return app.openapi_schema


def run_gateway(config: GatewayConfig,
                processes: Callable[[], Mapping[str, ProcessState]] | None = None) -> None:
    """Serve the gateway until SIGINT/SIGTERM."""
    configure_json_logging(config.log_level)
    shorten_switch_interval()  # the event loop gets the GIL back soon from the body pool's threads
    app = create_app(config, processes)
    freeze_startup_objects()  # no full GC pass walks the app again (~50 ms each)
    uvicorn.run(app, host=config.host, port=config.port, log_level="warning",
                access_log=False, backlog=8192, timeout_keep_alive=30, lifespan="on")
