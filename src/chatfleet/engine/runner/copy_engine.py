"""Where the host tier's copies run, and how the compute stream is ordered after them.

The host tier (``kv_transfer.py``) never copies on the compute stream directly: it hands each
store or load to a ``CopyEngine`` and gets a ``CopyEvent`` back. Two rules keep every step
correct, and both are stated against this interface only, so a test can check them on the CPU
with a copy engine that delays its copies (``tests/engine/runner/test_copy_ordering.py``):

- a load lands before the step that reads it: the runner makes the compute stream ``wait`` on
  the load's event before the forward pass;
- a store leaves before its block is reused: a device block whose store is still in flight is
  waited on before any step writes into it (``HostKVTransfer.before_write``).

Copies of one engine run in submission order (one stream), so a load of a host block a store of
the same plan wrote sees the stored bytes, and the copy stream first waits for the compute work
queued before the plan (``after_compute``): a store reads the KV the last step wrote.

``ImmediateCopyEngine`` (CPU, or a device without streams) runs a copy at once; its events are
done when returned. ``CudaCopyEngine`` runs copies on a stream of its own, ordered by CUDA events.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch


class CopyEvent(Protocol):
    def done(self) -> bool:
        """Whether the copy this event follows has completed."""
        ...


class CopyEngine(Protocol):
    def after_compute(self) -> None:
        """Copies submitted from now on start after the compute work queued so far."""
        ...

    def submit(self, copy: Callable[[], None]) -> CopyEvent:
        """Queue ``copy`` on the copy stream; the event completes when it has."""
        ...

    def wait(self, event: CopyEvent) -> None:
        """Compute work queued from now on starts after ``event``."""
        ...


class _Done:
    def done(self) -> bool:
        return True


DONE: CopyEvent = _Done()


class ImmediateCopyEngine:
    """Copies run when submitted (the compute stream is the only stream)."""

    def after_compute(self) -> None:
        pass

    def submit(self, copy: Callable[[], None]) -> CopyEvent:
        copy()
        return DONE

    def wait(self, event: CopyEvent) -> None:
        pass


class _CudaEvent:
    def __init__(self, event: torch.cuda.Event) -> None:
        self.event = event

    def done(self) -> bool:
        return bool(self.event.query())


class CudaCopyEngine:
    """Copies on a CUDA stream of their own; the compute stream is the device's current stream."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def after_compute(self) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def submit(self, copy: Callable[[], None]) -> CopyEvent:
        with torch.cuda.stream(self.stream):
            copy()
            event = torch.cuda.Event()
            event.record(self.stream)
        return _CudaEvent(event)

    def wait(self, event: CopyEvent) -> None:
        if isinstance(event, _CudaEvent):
            torch.cuda.current_stream(self.device).wait_event(event.event)


def copy_engine_for(device: torch.device) -> CopyEngine:
    """A stream of its own on CUDA; immediate copies elsewhere."""
    return CudaCopyEngine(device) if device.type == "cuda" else ImmediateCopyEngine()
