"""What tests, benchmarks, the bench and the gate share to run servers: one engine launcher
(``engines``) and one fake OpenAI server (``fake_server``)."""
