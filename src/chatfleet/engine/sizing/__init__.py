"""The engine's memory arithmetic, from a config.json alone (no torch, no weights).

- ``memory.py``: ``memory_breakdown``: weights by class, KV bytes per token, the pool a budget
  leaves; the engine logs and exports it, the planner predicts GPUs with it.
- ``tensors.py``: a model's tensors by shape and class (``ModelShape``);
  ``config_readers.py``: the readers by ``model_type`` (``readers.py``, ``gemma4_reader.py``).

Below the rest of the engine and below ``plan``: it imports only the KV spec
(``engine/kv/spec.py``), the FP8 weight format and Gemma 4's config reader, none of which
imports torch.
"""
