"""Structured output: grammars (JSON schemas, tool-call formats) compiled off the step loop and
cached, and the per-step token bitmask of a batch's constrained requests (llguidance)."""
