"""Layer-by-layer loading of host KV into the device pool, overlapped with the forward.

One loader thread copies each submitted job layer 0, 1, ..., L-1; a reader of layer ``l`` waits
only until every job submitted so far has written layer ``l`` (jobs run in order, so "layer l done"
is a per-layer counter). Data handed to the loader is already verified host memory: the copy
itself cannot produce wrong KV.

The loader is the KV pool's layer transfer counter (SGLang's ``register_layer_transfer_counter``,
the meeting point HiCache's ``LayerDoneCounter`` uses): the pool's ``get_key_buffer`` /
``get_value_buffer`` call :meth:`LayerwiseLoader.wait_until` before handing out a layer, so every
attention backend (ours, ``torch_native``, the GPU ones) waits per layer and the loads overlap
the forward whatever the backend.

On a CPU pool the loads run before the forward instead (:func:`beside_forward`): the forward's
OpenMP team keeps every core busy (its threads spin between regions), so a loader thread beside it
got a fraction of a core, and the forward lost what the loader took; a 4K history's copy took ~3x
as long as alone and the forward ~50 ms more (docs/decisions/2026-12-03-cpu-resume-loads-first.md).
Run first, the copy is one native call split over torch's threads (:mod:`sgl_loopkv.kernels.kv_load`).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from sgl_loopkv.cache.copy_stream import CopyStream
from sgl_loopkv.cache.quant import QuantKV
from sgl_loopkv.kernels import kv_load
from sgl_loopkv.platform import keep_torch_on_this_thread

logger = logging.getLogger(__name__)

DECODE_BLOCK = 512  # tokens of an int8 layer decoded at a time: SmolLM2's K and V of 512 tokens are 1.5 MB


def beside_forward(device: torch.device) -> bool:
    """Whether loads into a pool on ``device`` run on a loader thread beside the forward (CUDA: on
    their own stream) rather than before it. ``LOOPKV_LOAD_BESIDE_FORWARD=1`` keeps the loader
    thread on a CPU too (for comparison)."""
    return torch.device(device).type != "cpu" or os.environ.get("LOOPKV_LOAD_BESIDE_FORWARD", "0") == "1"


@dataclass(slots=True)
class LoadPart:
    """``kv[l]`` is layer l's [2, T, H, D] host copy (a tensor [L, 2, T, H, D], or a packed segment
    that decodes a layer on access); the first ``skip[l]`` tokens of layer l are not copied (the
    restorer recomputes them)."""

    kv: object
    slots: torch.Tensor  # [T] int64 device pool slots to fill
    skip: tuple[int, ...] | None = None


class LayerwiseLoader:
    def __init__(
        self,
        k_buffers: list[torch.Tensor],
        v_buffers: list[torch.Tensor],
        synchronous: bool = False,
        on_copy: Callable[[int, float, float], None] = lambda nbytes, decode_s, copy_s: None,
        on_wait: Callable[[float], None] = lambda seconds: None,
        started: bool = True,
    ):
        """``started=False``: the thread waits for :meth:`start` (its owner's, :mod:`~sgl_loopkv.cache.io_controller`)."""
        self.k_buffers, self.v_buffers = k_buffers, v_buffers
        self.on_copy, self.on_wait = on_copy, on_wait
        self.num_layers = len(k_buffers)
        self.synchronous = synchronous
        self._cond = threading.Condition()
        self._submitted = 0
        self._done = [0] * self.num_layers  # jobs that finished layer l
        self.copies = CopyStream(k_buffers[0].device)
        self._copied: list = [None] * self.num_layers  # CUDA: layer l's latest copy event, not yet waited on
        self._block: torch.Tensor | None = None  # the int8 decode buffer (loader thread only)
        self._kv_load = kv_load.load() if k_buffers[0].device.type == "cpu" else None
        first = k_buffers[0]  # every layer's buffer alike: a part's layers checked once (_whole_rows)
        self._uniform_pool = all(
            b.dtype == first.dtype and b.shape[1:] == first.shape[1:] and b.is_contiguous()
            for b in (*k_buffers, *v_buffers)
        )
        self._queue: queue.Queue[tuple[list[LoadPart], object] | None] = queue.Queue()
        self._thread = None
        if started:
            self.start()

    def start(self) -> None:
        """Start the loader thread (none for a synchronous loader); idempotent."""
        if not self.synchronous and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="loopkv-loader", daemon=True)
            self._thread.start()

    def submit(self, parts: list[LoadPart]) -> None:
        with self._cond:
            self._submitted += 1
        after = self.copies.submitted()
        if self.synchronous:
            self._copy(parts, after)
        else:
            self._queue.put((parts, after))

    @property
    def pending(self) -> bool:
        return self._done[-1] < self._submitted

    # --- SGLang's layer transfer counter interface (what the KV pool and the graph runner call) ---
    consumer_index = 0  # >= 0: there may be loads to wait for (SGLang skips the counter when < 0)

    def wait_until(self, layer: int) -> None:
        """The pool is about to hand out layer ``layer``: wait until its in-flight loads wrote it."""
        self.wait_layer(layer)

    def wait_layer(self, layer: int, bubble: bool = True) -> None:
        if self._done[layer] < self._submitted:  # loads in flight
            t0 = time.perf_counter()
            with self._cond:
                target = self._submitted
                while self._done[layer] < target:
                    self._cond.wait()
            if bubble:  # the forward had to wait for this layer
                self.on_wait(time.perf_counter() - t0)
        if self.copies.stream is not None:  # the copies are queued; the forward's stream waits for them
            with self._cond:  # one stream, jobs in order: the latest event covers the earlier ones
                event, self._copied[layer] = self._copied[layer], None
            CopyStream.wait(event)

    def wait_all(self) -> None:
        self.wait_layer(self.num_layers - 1, bubble=False)

    def _copy(self, parts: list[LoadPart], after) -> None:
        with self.copies.copying(after):
            done = self._copy_all_native(parts) if self.synchronous else set()
            for layer in range(self.num_layers):
                self._copy_layer(parts, layer, done)

    def _copy_all_native(self, parts: list[LoadPart]) -> set[tuple[int, int]]:
        """Synchronous loads: every (part, layer) the native kernel takes, in one call over torch's
        threads; returns those pairs (the per-layer pass skips them)."""
        if self._kv_load is None:
            return set()
        args: list[list] = [[] for _ in range(7)]  # k, v, k scales, v scales, slots, k pool, v pool
        done, nbytes, quantized = set(), 0, None
        for i, p in enumerate(parts):
            whole = self._whole_rows(p)
            if whole is not None and quantized in (None, whole[2] is not None):
                quantized = whole[2] is not None
                for a, x in zip(args[:4], whole[:4]):
                    a.extend(x if x is not None else ())
                args[4].extend([whole[4]] * self.num_layers)
                args[5].extend(self.k_buffers)
                args[6].extend(self.v_buffers)
                done.update((i, layer) for layer in range(self.num_layers))
                nbytes += (
                    2
                    * self.num_layers
                    * len(whole[4])
                    * self.k_buffers[0][0].numel()
                    * self.k_buffers[0].element_size()
                )
                continue
            for layer in range(self.num_layers):
                skip = p.skip[layer] if p.skip is not None else 0
                k_buf, v_buf = self.k_buffers[layer], self.v_buffers[layer]
                rows = self._native_rows(p, layer, skip, k_buf, v_buf)
                if rows is None:
                    continue
                k, v, k_scale, v_scale, slots = rows
                quantized = (k_scale is not None) if quantized is None else quantized
                if quantized != (k_scale is not None):  # one call takes one kind of rows: the rest per layer
                    continue
                scales = (k_scale, v_scale) if quantized else ()
                for a, x in zip(args, (k, v, *scales)):
                    a.append(x)
                for a, x in zip(args[4:], (slots, k_buf, v_buf)):
                    a.append(x)
                done.add((i, layer))
                nbytes += 2 * (len(p.slots) - skip) * k_buf[0].numel() * k_buf.element_size()
        if done:
            t0 = time.perf_counter()
            self._kv_load.load_layers(*args)
            self.on_copy(nbytes, 0.0, time.perf_counter() - t0)
        return done

    def _copy_layer(self, parts: list[LoadPart], layer: int, done: set[tuple[int, int]] = frozenset()) -> None:
        try:
            decode_s = copy_s = 0.0
            nbytes = 0
            k_buf, v_buf = self.k_buffers[layer], self.v_buffers[layer]
            for i, p in enumerate(parts):
                skip = p.skip[layer] if p.skip is not None else 0
                n = len(p.slots)
                if skip >= n or (i, layer) in done:
                    continue
                a = time.perf_counter()
                if self._native_layer(p, layer, skip, k_buf, v_buf):  # decoded inside the copy
                    nbytes += 2 * (n - skip) * k_buf[0].numel() * k_buf.element_size()
                    copy_s += time.perf_counter() - a
                    continue
                # int8 rows decode a block at a time into one reused buffer that stays in the CPU's
                # cache, not into a layer-sized temporary written out to memory and read back
                blocked = isinstance(p.kv, QuantKV) and k_buf.device.type == "cpu"
                step = DECODE_BLOCK if blocked else n
                for t0 in range(skip, n, step):
                    t1 = min(t0 + step, n)
                    a = time.perf_counter()
                    kv = self._decoded(p.kv, layer, t0, t1, blocked)
                    b = time.perf_counter()
                    k_buf.index_copy_(0, p.slots[t0:t1], kv[0].to(k_buf.device, k_buf.dtype))
                    v_buf.index_copy_(0, p.slots[t0:t1], kv[1].to(v_buf.device, v_buf.dtype))
                    nbytes += kv.numel() * k_buf.element_size()
                    decode_s, copy_s = decode_s + b - a, copy_s + time.perf_counter() - b
            if nbytes:
                self.on_copy(nbytes, decode_s, copy_s)
        except Exception:  # never leave the forward waiting on a layer that will not come
            logger.exception("loopkv: copying layer %d into the KV pool failed", layer)
        event = self.copies.copied()
        with self._cond:
            if event is not None:
                self._copied[layer] = event
            self._done[layer] += 1
            self._cond.notify_all()

    def _whole_rows(self, p: LoadPart):
        """A part with nothing skipped, every layer's rows as :mod:`sgl_loopkv.kernels.kv_load` takes
        them, taken apart in a few calls: (k per layer, v per layer, k scales, v scales (None for rows
        in the pool's dtype), slots); None where :meth:`_native_rows` decides layer by layer (rows
        skipped, a packed segment, pool buffers that differ by layer). Slicing each layer's four
        tensors one by one cost more than a millisecond a resume."""
        if self._kv_load is None or not self._uniform_pool or (p.skip is not None and any(p.skip)):
            return None
        if isinstance(p.kv, QuantKV):
            q, scale = p.kv.q, p.kv.scale
        elif isinstance(p.kv, torch.Tensor):
            q, scale = p.kv, None
        else:
            return None
        if len(p.slots) == 0 or q.dim() != 5 or q.shape[0] != self.num_layers or q.shape[2] != len(p.slots):
            return None
        if not kv_load.fits(q[0, 0], self.k_buffers[0]):  # every layer's rows are slices of q alike
            return None
        slots = (
            p.slots
            if p.slots.dtype == torch.int64 and p.slots.is_contiguous()
            else p.slots.to(torch.int64).contiguous()
        )
        k, v = zip(*(layer.unbind(0) for layer in q.unbind(0)))
        if scale is None:
            return k, v, None, None, slots
        k_scale, v_scale = zip(*(layer.unbind(0) for layer in scale.unbind(0)))
        return k, v, k_scale, v_scale, slots

    def _native_rows(self, p: LoadPart, layer: int, skip: int, k_buf: torch.Tensor, v_buf: torch.Tensor):
        """(k, v, k scales, v scales, slots) of layer ``layer`` of ``p`` from token ``skip`` on, as
        :mod:`sgl_loopkv.kernels.kv_load` takes them; None where it does not apply (no kernel, a
        shared layer, a pool it does not take, nothing to copy)."""
        if self._kv_load is None or skip >= len(p.slots):
            return None
        if isinstance(p.kv, QuantKV):
            k, v = p.kv.q[layer, 0, skip:], p.kv.q[layer, 1, skip:]
            k_scale, v_scale = p.kv.scale[layer, 0, skip:], p.kv.scale[layer, 1, skip:]
        elif isinstance(p.kv, torch.Tensor):
            k, v = p.kv[layer, 0, skip:], p.kv[layer, 1, skip:]
            k_scale = v_scale = None
        else:
            return None
        if not (kv_load.fits(k, k_buf) and kv_load.fits(v, v_buf)):
            return None
        slots = p.slots[skip:]
        if slots.dtype != torch.int64 or not slots.is_contiguous():
            slots = slots.to(torch.int64).contiguous()
        return k, v, k_scale, v_scale, slots

    def _native_layer(self, p: LoadPart, layer: int, skip: int, k_buf: torch.Tensor, v_buf: torch.Tensor) -> bool:
        """Layer ``layer`` of ``p`` through the native kernel on this thread; False (nothing copied)
        where it does not apply."""
        rows = self._native_rows(p, layer, skip, k_buf, v_buf)
        if rows is None:
            return False
        self._kv_load.load_layer(*rows[:4], rows[4], k_buf, v_buf)
        return True

    def _decoded(self, kv, layer: int, t0: int, t1: int, blocked: bool) -> torch.Tensor:
        """Tokens [t0, t1) of layer ``layer`` of a part's KV as [2, t1 - t0, H, D]: a view of a plain
        tensor, a shared layer decoded whole, an int8 block decoded (``blocked``: into the loader's
        reused buffer; a CPU pool's copy out of it finishes before the next block is decoded)."""
        if not isinstance(kv, QuantKV):
            return kv[layer][:, t0:t1]
        q, scale = kv.q[layer, :, t0:t1], kv.scale[layer, :, t0:t1].unsqueeze(-1)
        if not blocked:
            return torch.mul(q, scale)
        if self._block is None or self._block.shape[2:] != q.shape[2:] or self._block.shape[1] < q.shape[1]:
            self._block = torch.empty((2, max(q.shape[1], DECODE_BLOCK), *q.shape[2:]), dtype=torch.float32)
        out = self._block[:, : q.shape[1]]
        return torch.mul(q, scale, out=out)

    def _run(self) -> None:
        keep_torch_on_this_thread()  # no OpenMP team of its own: it would slow every later forward
        while True:
            job = self._queue.get()
            if job is None:
                return
            self._copy(*job)

    def close(self) -> None:
        """Finish the queued loads, then stop the thread (idempotent)."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout=10)
