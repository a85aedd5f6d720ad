"""The CLI starts at once: importing the command tree pulls in neither torch nor a web framework
(each command imports what it needs when it runs). Checked in a fresh interpreter, by the modules
loaded, not by a clock."""

import json
import subprocess
import sys

HEAVY = ("torch", "fastapi", "starlette", "transformers", "safetensors", "matplotlib", "chatfleet.engine.engine")


def loaded_after(code: str) -> set[str]:
    probe = f"import json, sys\n{code}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_importing_the_cli_pulls_in_no_torch():
    mods = loaded_after("import chatfleet.cli.main")
    assert "chatfleet.cli.main" in mods
    assert not [m for m in HEAVY if m in mods], [m for m in HEAVY if m in mods]


def test_help_and_a_usage_error_stay_light():
    for args in (["--help"], ["engine", "--help"], ["bench", "--bogus"], ["model", "tiny", "--help"]):
        code = ("from chatfleet.cli.main import app\n"
                f"try:\n    app({args!r})\nexcept SystemExit:\n    pass")
        mods = loaded_after(code)
        assert not [m for m in HEAVY if m in mods], (args, [m for m in HEAVY if m in mods])
