"""Host-to-device copies issued by a tier thread (the layer loader, the chunk reader) beside the forward.

On CUDA, a thread that copies on the legacy default stream is ordered against every kernel of
every blocking stream: the forward's kernels queued after a copy wait for it whether or not they
read its layer. So each tier thread copies on a stream of its own and the two sides meet at events:

- a job's copies come after the forward work queued when the job was submitted (its slot lists
  are computed there, and a slot it rewrites may still be read by an earlier layer's attention);
- the forward's stream waits, per layer, for the event recorded once that layer is copied.

On CPU the copies are synchronous and every method is a no-op (no events are made).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch


class CopyStream:
    def __init__(self, device: torch.device | str):
        device = torch.device(device)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def submitted(self) -> torch.cuda.Event | None:
        """Forward thread, as a job is submitted: what the job's copies must come after."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.stream.device))
        return event

    @contextlib.contextmanager
    def copying(self, after: torch.cuda.Event | None) -> Iterator[None]:
        """Copy thread: the job's copies run on this stream, after ``after``."""
        if self.stream is None:
            yield
            return
        with torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)
            yield

    def copied(self) -> torch.cuda.Event | None:
        """Copy thread, inside :meth:`copying`, once a layer's copies are queued: its event."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    @staticmethod
    def wait(event: torch.cuda.Event | None) -> None:
        """Forward thread: its current stream waits for a copied layer (CPU: nothing to wait for)."""
        if event is not None:
            torch.cuda.current_stream().wait_event(event)


PINNED_ENV = "LOOPKV_HOST_PINNED"


def pinned_host(device: torch.device | str, env: dict | None = None) -> bool:
    """Whether the host tier's buffers for a pool on ``device`` are page-locked: on CUDA unless
    ``LOOPKV_HOST_PINNED=0`` (pinned host-to-device copies are several times faster than pageable
    ones, benchmarks/results/gpu_copy_overlap.md, and only they overlap compute); never on CPU.
    They count against ``--loopkv-tier-host-bytes`` like any host-tier bytes. Segments read back from
    disk stay pageable (not built yet)."""
    if torch.device(device).type != "cuda":
        return False
    return (os.environ if env is None else env).get(PINNED_ENV, "1").strip() not in ("0", "false", "no")
