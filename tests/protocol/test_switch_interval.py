"""The servers' processes run with a short GIL switch interval: a thread that wants the GIL
back (the engine's step loop, after each kernel) waits at most that long behind the event loop."""

from __future__ import annotations

import gc
import sys

import pytest

from chatfleet.protocol.switch_interval import SERVER_SWITCH_INTERVAL_S, shorten_switch_interval


@pytest.fixture
def restore_interval():
    before = sys.getswitchinterval()
    yield
    sys.setswitchinterval(before)
    gc.unfreeze()


def test_the_interval_is_shortened_never_lengthened(restore_interval):
    sys.setswitchinterval(0.005)
    assert shorten_switch_interval() == 0.005
    assert sys.getswitchinterval() == pytest.approx(SERVER_SWITCH_INTERVAL_S)
    sys.setswitchinterval(0.0001)  # already shorter (set by whoever embeds the server): kept
    shorten_switch_interval()
    assert sys.getswitchinterval() == pytest.approx(0.0001)
    with pytest.raises(ValueError, match="> 0"):
        shorten_switch_interval(0)


def test_engine_and_gateway_serve_with_the_short_interval_and_start_up_frozen(restore_interval, monkeypatch):
    import chatfleet.engine.api.server as engine_server
    import chatfleet.gateway.app as gateway_app
    from chatfleet.gateway.config import GatewayConfig, ReplicaSpec

    seen: dict[str, float] = {}
    frozen: list[int] = []

    def served(name: str):
        # (returns False: for the engine, "its engine did not die")
        return lambda app, **kw: bool(seen.update({name: sys.getswitchinterval()})
                                      or frozen.append(gc.get_freeze_count()))

    sys.setswitchinterval(0.005)
    monkeypatch.setattr(engine_server, "build_engine", lambda config: type("E", (), {"model_name": "m"})())
    monkeypatch.setattr(engine_server, "build_app", lambda engine, **kw: object())
    monkeypatch.setattr(engine_server, "serve_until_stopped", served("engine"))
    from chatfleet.engine.api.options import ServerOptions

    # the API process of either layout (the core process shortens its own: run_core)
    engine_server.run_server(type("C", (), {"model": "m"})(),  # type: ignore[arg-type]
                             options=ServerOptions(engine_process=False))
    gc.unfreeze()
    sys.setswitchinterval(0.005)
    monkeypatch.setattr(gateway_app, "configure_json_logging", lambda level: None)
    monkeypatch.setattr(gateway_app.uvicorn, "run", served("gateway"))
    gateway_app.run_gateway(GatewayConfig(replicas=(ReplicaSpec("http://127.0.0.1:9"),)))
    short = pytest.approx(SERVER_SWITCH_INTERVAL_S)
    assert seen == {"engine": short, "gateway": short}
    assert len(frozen) == 2 and all(frozen)  # what they hold at start-up is out of the GC's passes
