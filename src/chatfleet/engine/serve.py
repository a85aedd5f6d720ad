"""Run one engine process: check the KV pools fit, set torch's threads, serve HTTP until stopped.

The engine's own log (the memory table and the KV pool at start-up) goes to the console at the
server's ``--log-level``, beside uvicorn's lines and in their format.

Both entries end here: ``chatfleet engine`` (typer flags) and ``python -m chatfleet.engine``
(the launcher's argv, ``engine/argv.py``).
"""

from __future__ import annotations

from chatfleet.engine.argv import EngineServer
from chatfleet.engine.config import EngineConfig
from chatfleet.engine.console_log import console_logging
from chatfleet.engine.memory_check import check_kv_fits


def serve_engine(config: EngineConfig, server: EngineServer) -> None:
    """Serve ``config`` on ``server.host:server.port`` (blocks; ChatfleetError before serving)."""
    console_logging(server.log_level)
    check_kv_fits(config.cache.memory_bytes or 0, config.cache.host_memory_bytes, config.device)
    if config.num_threads is not None:
        import torch

        torch.set_num_threads(config.num_threads)
    from chatfleet.engine.api.server import run_server

    run_server(config, host=server.host, port=server.port, log_level=server.log_level, options=server.options)
