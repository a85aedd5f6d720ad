"""Memory math and capacity prediction for GPUs you do not have (``memory.py``: the one memory
arithmetic the engine shares)."""
