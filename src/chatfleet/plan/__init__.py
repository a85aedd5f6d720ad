"""Memory math and capacity prediction for GPUs you do not have.

- ``memory_report.py``, ``capacity.py``, ``vllm_pool.py``: ``chatfleet plan memory``, over the
  engine's own memory arithmetic (``engine/sizing/``, which the planner imports, never the reverse).
- ``catalog.py`` + ``gpus.yaml``: the GPU catalog (spec-sheet rates, efficiency factors).
- ``cost_model.py``: the roofline step cost; ``virtual_loop.py``: asyncio in virtual time;
  ``sim_replica.py``: the real engine over a ``SimRunner`` in virtual time; ``sim_load.py``: the
  bench's traffic as token ids; ``sim_bench.py``: the bench's sweep over simulated runs;
  ``sim_fleet.py``: replicas behind the gateway's routing and admission; ``host_sweep.py``:
  host-tier sizing; ``calibrate.py``: efficiency factors from a measured sweep.
- ``prefixes.py`` + ``prefix_hits.py``: ``chatfleet plan prefixes``.
"""
