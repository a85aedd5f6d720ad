"""The engine's HTTP front: OpenAI-compatible server, the asyncio bridge to the step loop,
request conversion, responders and Prometheus metrics. The step loop itself stays in
``chatfleet.engine`` (engine.py, scheduler.py, kv/, runner/)."""
