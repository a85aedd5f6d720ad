"""One environment variable for API keys everywhere: CHATFLEET_API_KEYS for the engine, the
gateway and `serve`; the engine's old CHATFLEET_API_KEY still read, with a warning."""

from typer.testing import CliRunner

from chatfleet.cli import gateway_cmd
from chatfleet.engine.api.options import ServerOptions
from chatfleet.gateway.config import Profile
from chatfleet.protocol.api_keys import API_KEYS_ENV, keys_from_env, split_keys


def test_the_new_name_wins_and_the_old_one_warns(capsys):
    assert keys_from_env({API_KEYS_ENV: "a, b,,c"}) == ("a", "b", "c")
    assert capsys.readouterr().err == ""
    assert keys_from_env({API_KEYS_ENV: "new", "CHATFLEET_API_KEY": "old"}) == ("new",)
    assert keys_from_env({"CHATFLEET_API_KEY": "old"}) == ("old",)
    err = capsys.readouterr().err
    assert err.startswith("warning: CHATFLEET_API_KEY") and "CHATFLEET_API_KEYS" in err and err.count("\n") == 1
    assert keys_from_env({}) == () and split_keys(["a,b", " c "]) == ("a", "b", "c")


def test_engine_and_gateway_read_the_same_variable(monkeypatch):
    monkeypatch.delenv("CHATFLEET_API_KEY", raising=False)
    monkeypatch.setenv(API_KEYS_ENV, "k1,k2")
    assert ServerOptions.keys_from(None) == ("k1", "k2")
    assert ServerOptions.keys_from("flag") == ("flag",)
    flags = gateway_cmd._flags(None, None, None, None, None, None, None, None, None)
    cfg = gateway_cmd.build_gateway_config(Profile(), ["http://127.0.0.1:1"], flags, None)
    assert cfg.api_keys == ("k1", "k2")
    flags = gateway_cmd._flags(None, None, None, None, None, ["x,y", "z"], None, None, None)
    assert gateway_cmd.build_gateway_config(Profile(), ["http://127.0.0.1:1"], flags, None).api_keys == ("x", "y", "z")


def test_help_names_the_one_variable():
    from chatfleet.cli.main import app

    for command in ("engine", "gateway", "serve"):
        out = " ".join(CliRunner().invoke(app, [command, "--help"], terminal_width=200).output.split())
        assert "CHATFLEET_API_KEYS" in out and "CHATFLEET_API_KEY " not in out, command
