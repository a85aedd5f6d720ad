"""chatfleet: serve multi-turn chat LLMs at the most live conversations per GPU inside a latency target."""
__version__ = "0.1.0"
