"""`chatfleet gateway` (front an existing fleet) and `chatfleet serve` (start one, then front it).

Settings come from the GatewayConfig defaults, then a YAML profile (--profile), then flags.
"""

from __future__ import annotations

import dataclasses
import signal
import socket
from pathlib import Path
from typing import Any

import typer

from chatfleet.cli.errors import check_port
from chatfleet.errors import ChatfleetError, ConfigError
from chatfleet.gateway.config import GatewayConfig, Profile, load_profile
from chatfleet.gateway.knee import read_knee
from chatfleet.protocol.api_keys import API_KEYS_ENV, keys_from_env, split_keys

_G = GatewayConfig()

# Options both commands share (typer needs them spelled out per command).
_REPLICA = typer.Option(None, "--replica", help="Replica base URL; repeat for several.")
_PROFILE = typer.Option(None, "--profile", help="YAML profile (sections: gateway, serve, engine).")
_HOST = typer.Option(None, "--host", help=f"Gateway address (default: {_G.host}).")
_PORT = typer.Option(None, "--port", help=f"Gateway port (default: {_G.port}).")
_CAP = typer.Option(None, "--max-in-flight", help="Per-replica in-flight cap (default: none).")
_CAPS_FROM = typer.Option(None, "--caps-from", help="`chatfleet sweep` JSON result: cap = the requests in "
                          "flight at its knee (a closed-loop knee, in live chats, converted by Little's law).")
_CAPS_SERIES = typer.Option(None, "--caps-series", help="Series of --caps-from to read (if it holds several).")
_QUEUE = typer.Option(None, "--queue-size", help=f"Requests that may wait (default: {_G.queue_size}).")
_WAIT = typer.Option(None, "--max-queue-wait", help=f"Seconds a request may wait (default: {_G.max_queue_wait_s:g}).")
_KEYS = typer.Option(None, "--api-key", help=f"Accepted Bearer key; repeat, or comma-separate in {API_KEYS_ENV}.")
_HEADER = typer.Option(None, "--session-header", help=f"Session-id header (default: {_G.session_header}).")
_POLICY = typer.Option(None, "--routing-policy", help=f"Routing policy (default: {_G.routing_policy}).")
_LOG = typer.Option(None, "--log-level", help=f"Log level (default: {_G.log_level}).")
_CONNECT = typer.Option(None, "--connect-timeout", help=f"Seconds to connect to a replica (default: "
                                                        f"{_G.connect_timeout_s:g}).")
_READ = typer.Option(None, "--read-timeout", help=f"Longest silence from a replica, in seconds (default: "
                                                  f"{_G.read_timeout_s:g}).")
_TOTAL = typer.Option(None, "--total-timeout", help="Seconds a whole upstream call may take, stream included "
                                                    "(default: no limit).")
_BODY = typer.Option(None, "--max-body-bytes", help=f"Largest request body (default: {_G.max_body_bytes}).")
_NEWQ = typer.Option(None, "--max-queued-new", help="First turns of new conversations that may wait (default: "
                                                    "half of --queue-size).")
_FROM = typer.Option(None, "--replicas-from", help="Discover replicas: dns://HOST:PORT (a headless Service's "
                     "A records, re-resolved) or k8s://NAMESPACE/SERVICE (its EndpointSlices; "
                     "add :PORT to pick a port by name).")
_STATE = typer.Option(None, "--state", help="redis://HOST:PORT: conversations in progress, shared by every "
                      "gateway using it.")
_GATEWAYS = typer.Option(None, "--gateways", help="Gateways in front of the same replicas: each enforces "
                         "cap / N (default: 1).")
_ADMIN = typer.Option(None, "--admin-key", help="Bearer key for POST /reset_prefix_cache; repeat for several "
                      "(default: open only when no --api-key is set).")
_KEY_CAP = typer.Option(None, "--key-max-in-flight", help="Requests one API key may have in flight "
                        "(default: no limit).")
_KEY_TPM = typer.Option(None, "--key-tokens-per-minute", help="Prompt + max_tokens one API key may ask for "
                        "per minute (default: no limit).")
_TTL = typer.Option(None, "--session-ttl", help=f"Seconds a conversation counts as in progress after its last "
                                                f"turn (default: {_G.session_ttl_s:g}).")


def build_gateway_config(profile: Profile, replicas: list[str] | None, flags: dict[str, Any],
                         caps_from: Path | None, caps_series: str | None = None) -> GatewayConfig:
    """Defaults < profile < flags. ``replicas`` from flags replace the profile's list."""
    settings = dict(profile.gateway)
    if replicas:
        settings["replicas"] = tuple(replicas)
    settings.update({k: v for k, v in flags.items() if v is not None})
    for name in ("api_keys", "admin_api_keys"):
        if name in settings:
            keys = settings[name]
            keys = [keys] if isinstance(keys, str) else list(keys)
            settings[name] = tuple(k.strip() for key in keys for k in key.split(",") if k.strip())
    if caps_from is not None:
        if flags.get("max_in_flight") is not None:
            raise ConfigError("give either --max-in-flight or --caps-from, not both")
        settings["max_in_flight"] = read_knee(caps_from, caps_series)
    return GatewayConfig.from_dict(settings)


def _flags(host, port, max_in_flight, queue_size, max_queue_wait, api_key, session_header,
           routing_policy, log_level, connect_timeout=None, read_timeout=None, total_timeout=None,
           max_body_bytes=None, max_queued_new=None, session_ttl=None, **fleet: Any) -> dict[str, Any]:
    return {"host": host, "port": port, "max_in_flight": max_in_flight, "queue_size": queue_size,
            "max_queue_wait_s": max_queue_wait,
            "api_keys": split_keys(api_key) if api_key else (keys_from_env() or None),
            "session_header": session_header, "routing_policy": routing_policy, "log_level": log_level,
            "connect_timeout_s": connect_timeout, "read_timeout_s": read_timeout,
            "total_timeout_s": total_timeout, "max_body_bytes": max_body_bytes,
            "max_queued_new": max_queued_new, "session_ttl_s": session_ttl,
            **_fleet_flags(**fleet)}


def _fleet_flags(replicas_from=None, state=None, gateways=None, admin_key=None, key_max_in_flight=None,
                 key_tokens_per_minute=None) -> dict[str, Any]:
    return {"replicas_from": replicas_from, "state": state, "gateways": gateways,
            "admin_api_keys": split_keys(admin_key) if admin_key else None,
            "key_max_in_flight": key_max_in_flight, "key_tokens_per_minute": key_tokens_per_minute}


def client_address(host: str, port: int) -> str:
    """The OpenAI base URL clients should use for a gateway bound to HOST:PORT."""
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()
    elif ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}/v1"


def _announce(config: GatewayConfig) -> None:
    typer.echo(f"gateway on {config.host}:{config.port}; clients use base URL "
               f"{client_address(config.host, config.port)}", err=True)


def _fail(err: ChatfleetError) -> None:
    typer.echo(f"error: {err.message}", err=True)
    raise typer.Exit(2)


def gateway(
    replica: list[str] | None = _REPLICA, profile: Path | None = _PROFILE, host: str | None = _HOST,
    port: int | None = _PORT, max_in_flight: int | None = _CAP, caps_from: Path | None = _CAPS_FROM,
    caps_series: str | None = _CAPS_SERIES, queue_size: int | None = _QUEUE, max_queue_wait: float | None = _WAIT,
    api_key: list[str] | None = _KEYS, session_header: str | None = _HEADER,
    routing_policy: str | None = _POLICY, log_level: str | None = _LOG,
    connect_timeout: float | None = _CONNECT, read_timeout: float | None = _READ,
    total_timeout: float | None = _TOTAL, max_body_bytes: int | None = _BODY,
    max_queued_new: int | None = _NEWQ, session_ttl: float | None = _TTL,
    replicas_from: str | None = _FROM, state: str | None = _STATE, gateways: int | None = _GATEWAYS,
    admin_key: list[str] | None = _ADMIN, key_max_in_flight: int | None = _KEY_CAP,
    key_tokens_per_minute: int | None = _KEY_TPM,
) -> None:
    """OpenAI-compatible gateway over running replicas (built-in engine, vLLM, SGLang, ...)."""
    from chatfleet.gateway.app import run_gateway

    try:
        prof = load_profile(profile) if profile else Profile()
        config = build_gateway_config(prof, replica, _flags(
            host, port, max_in_flight, queue_size, max_queue_wait, api_key, session_header,
            routing_policy, log_level, connect_timeout, read_timeout, total_timeout, max_body_bytes,
            max_queued_new, session_ttl, replicas_from=replicas_from, state=state, gateways=gateways,
            admin_key=admin_key, key_max_in_flight=key_max_in_flight,
            key_tokens_per_minute=key_tokens_per_minute), caps_from, caps_series)
        if not config.replicas and config.replicas_from is None:
            raise ConfigError("no replicas: give --replica URL (repeatable), --replicas-from dns://HOST:PORT "
                              "or a profile's gateway.replicas")
        check_port(config.host, config.port)
    except ChatfleetError as err:
        _fail(err)
    _announce(config)
    run_gateway(config)


def serve(
    replicas: int | None = typer.Option(None, "--replicas", help="Engine processes to start (default: 2, or 0 "
                                                                 "with --replica)."),
    engine: str | None = typer.Option(None, "--engine", help="Engine kind: chatfleet (built-in) or vllm "
                                      "(the same settings as vLLM flags; default: chatfleet)."),
    vllm_python: str | None = typer.Option(None, "--vllm-python", help="Python with vLLM installed "
                                           "(default: $CHATFLEET_VLLM_PYTHON, else this one)."),
    model: str | None = typer.Option(None, "--model", help="tiny, small, or a local HF folder (default: tiny)."),
    threads_per_replica: int | None = typer.Option(None, "--threads-per-replica", help="torch threads each "
                                                                                       "(default: cores / replicas)."),
    engine_port_base: int | None = typer.Option(None, "--engine-port-base", help="First engine port (default: "
                                                                                 "free ports)."),
    engine_arg: list[str] | None = typer.Option(None, "--engine-arg", help="Extra `chatfleet engine` flag, "
                                                "e.g. --engine-arg --kv-cache-tokens=8192 (repeat for more)."),
    replica: list[str] | None = _REPLICA, profile: Path | None = _PROFILE, host: str | None = _HOST,
    port: int | None = _PORT, max_in_flight: int | None = _CAP, caps_from: Path | None = _CAPS_FROM,
    caps_series: str | None = _CAPS_SERIES, queue_size: int | None = _QUEUE, max_queue_wait: float | None = _WAIT,
    api_key: list[str] | None = _KEYS, session_header: str | None = _HEADER,
    routing_policy: str | None = _POLICY, log_level: str | None = _LOG,
    connect_timeout: float | None = _CONNECT, read_timeout: float | None = _READ,
    total_timeout: float | None = _TOTAL, max_body_bytes: int | None = _BODY,
    max_queued_new: int | None = _NEWQ, session_ttl: float | None = _TTL,
    state: str | None = _STATE, gateways: int | None = _GATEWAYS, admin_key: list[str] | None = _ADMIN,
    key_max_in_flight: int | None = _KEY_CAP, key_tokens_per_minute: int | None = _KEY_TPM,
) -> None:
    """Start N engines (built-in, or vLLM with --engine vllm) and the gateway in front of them;
    Ctrl-C stops everything."""
    from chatfleet.cli.vllm_fleet import VllmFleet, check_kind, vllm_env
    from chatfleet.engine.builtin_models.tiny import resolve_model
    from chatfleet.engine.launcher import Fleet, FleetConfig
    from chatfleet.gateway.app import run_gateway
    from chatfleet.gateway.supervisor import ReplicaSupervisor

    try:
        prof = load_profile(profile) if profile else Profile()
        settings = dict(prof.serve)
        unknown = sorted(set(settings) - {"replicas", "model", "threads_per_replica", "base_port",
                                          "startup_timeout_s", "stop_timeout_s", "engine"})
        if unknown:
            raise ConfigError(f"unknown serve setting(s) {unknown} in the profile")
        kind = check_kind(engine or settings.pop("engine", None) or "chatfleet")
        settings.pop("engine", None)
        given = {"replicas": replicas, "model": model, "threads_per_replica": threads_per_replica,
                 "base_port": engine_port_base}
        settings.update({k: v for k, v in given.items() if v is not None})
        if replica and replicas is None:
            settings["replicas"] = 0
        settings["engine_args"] = FleetConfig.engine_flags(prof.engine) + tuple(engine_arg or ())
        fleet_config = FleetConfig(**settings)
        if kind == "vllm":
            fleet_config = dataclasses.replace(fleet_config, extra_env=vllm_env(fleet_config.threads()))
        gateway_config = build_gateway_config(prof, replica, _flags(
            host, port, max_in_flight, queue_size, max_queue_wait, api_key, session_header,
            routing_policy, log_level, connect_timeout, read_timeout, total_timeout, max_body_bytes,
            max_queued_new, session_ttl, state=state, gateways=gateways, admin_key=admin_key,
            key_max_in_flight=key_max_in_flight, key_tokens_per_minute=key_tokens_per_minute),
            caps_from, caps_series)
        if fleet_config.replicas == 0 and not gateway_config.replicas:
            raise ConfigError("nothing to serve: --replicas 0 and no --replica URL")
        check_port(gateway_config.host, gateway_config.port)
    except ChatfleetError as err:
        _fail(err)

    def interrupt(signum, frame):  # SIGTERM ends `serve` like Ctrl-C: engines stop in `finally`
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    fleet = (VllmFleet(fleet_config, prepare_model=resolve_model, python=vllm_python) if kind == "vllm"
             else Fleet(fleet_config, prepare_model=resolve_model))
    if isinstance(fleet, VllmFleet) and fleet.dropped:
        typer.echo(f"vLLM has no equivalent of {', '.join(fleet.dropped)}: left out "
                   "(vLLM evicts LRU and schedules FCFS)", err=True)
    supervisor = None
    try:
        urls = fleet.start()
        if urls:
            typer.echo(f"engines ready: {' '.join(urls)} (restarted if they die)", err=True)
        supervisor = ReplicaSupervisor(fleet).start()
        # uvicorn stops on SIGINT/SIGTERM, then re-raises the signal into the handlers found
        # here, so both end up as KeyboardInterrupt and the engines stop below.
        attached = [spec.url for spec in gateway_config.replicas]
        config = gateway_config.replace(replicas=tuple(urls) + tuple(attached))
        _announce(config)
        run_gateway(config, supervisor.states)
    except KeyboardInterrupt:
        pass
    except ChatfleetError as err:
        _fail(err)
    finally:
        if supervisor is not None:
            supervisor.stop()
        fleet.stop()
        signal.signal(signal.SIGTERM, previous)


def register(app: typer.Typer) -> None:
    """Add the `gateway` and `serve` commands to `app`."""
    app.command("gateway")(gateway)
    app.command("serve")(serve)
