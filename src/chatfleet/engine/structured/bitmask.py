"""The token bitmask of one step: which tokens each constrained request may sample next."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray


@dataclass(frozen=True)
class TokenBitmask:
    """The tokens constrained requests may sample next (structured output, engine/structured/):
    row i of ``bits`` belongs to ``request_ids[i]``; bit j of int32 word w allows token 32 w + j."""

    request_ids: tuple[str, ...]
    bits: NDArray[np.int32]  # [len(request_ids), ceil(vocab / 32)]

    def rows_of(self, request_ids: list[str]) -> tuple[list[int], NDArray[np.int32]]:
        """For a batch of ``request_ids``: the positions of the constrained ones, and their rows."""
        row = {rid: i for i, rid in enumerate(self.request_ids)}
        found = [(pos, row[rid]) for pos, rid in enumerate(request_ids) if rid in row]
        return [pos for pos, _ in found], self.bits[[r for _, r in found]]

    def allows(self, row: int, token_id: int) -> bool:
        """Whether row ``row`` allows ``token_id``."""
        word = int(self.bits[row, token_id // 32]) & 0xFFFFFFFF
        return bool((word >> (token_id % 32)) & 1)
