"""Decode the next batch in a background thread, on a side stream, while the current one trains.

torchcodec's CUDA decoder host-synchronises its stream twice per call (before nvJPEG's hardware batch, a
workaround for an nvJPEG bug, and before returning, so its buffers can be reused): called inside the step, on
the training stream, each call would stall the training thread until the GPU drained. Here a thread of its own
decodes batch i+1 on a side stream (job.data.streams) while batch i trains, so both syncs wait only for the
decode's own work and block only that thread; torchcodec's op runs without the GIL. The training thread takes
the decoded batch through a queue and makes its stream wait on the batch's event (``record_stream`` for the
allocator), exactly as DevicePrefetcher hands over a copy.

Order and exact resume: the loader (its sampler) stays the only source of order; the thread pulls from it in
order and hands batches over in that order. It decodes at most one batch ahead of the consumer and holds at
most one more encoded batch, both discarded when the consumer stops; the trainer's counter
(job.data.loaders.Loaders.batches) counts a batch when the consumer takes it, so a checkpoint records exactly
the consumed position, as with DevicePrefetcher. Each pass over the loader (an epoch, an evaluation) has its
own thread, started after the sampler's position is set and ended with the pass: at the end of the epoch, on an
error (re-raised in the training thread, the thread's own errors included), and when the consumer stops early
(a stop signal, the last step, an exception in the step: closing the iterator stops and joins the thread).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from job.data.streams import SideStream

AHEAD = 1
"""Decoded batches waiting for the consumer: one, decoded while the current batch trains."""
JOIN_S = 30.0
"""How long closing waits for the thread: it may be inside the loader, waiting for a worker's next batch."""
THREAD_NAME = "ddp-job-decode"
log = logging.getLogger("job")


class DecodeAhead:
    """Iterable over ``loader`` yielding ``decode(batch)`` (a tuple of tensors), each decoded in a background
    thread on ``side`` one batch ahead of the consumer. ``len()`` is the loader's."""

    def __init__(self, loader: Any, decode: Callable[[Any], tuple[torch.Tensor, ...]], side: SideStream) -> None:
        self.loader, self.decode, self.side = loader, decode, side

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        source = iter(self.loader)
        # The first batch is read here, in the caller's thread: the DataLoader starts its workers (and installs
        # its SIGCHLD handler, main thread only) on that first read. Its errors surface here as they are.
        first = next(source, _END)
        if first is _END:
            return
        worker = _Worker(source, first, self.decode, self.side)
        try:
            while True:
                batch = worker.take()
                if batch is None:
                    return
                yield batch
        finally:
            worker.stop()


class _End:
    pass


_END = _End()


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class _Worker:
    """The thread of one pass over the loader and its handover to the consumer."""

    def __init__(self, source: Iterator[Any], first: Any, decode: Callable[[Any], Any], side: SideStream) -> None:
        self.source, self.next_batch, self.decode, self.side = source, first, decode, side
        self.results: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.slots = threading.Semaphore(AHEAD)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.side.enter_thread()
            while self._next():
                pass
        except BaseException as e:  # handed to the consumer, which raises it; nothing is lost with the thread
            self.results.put(_Failed(e))

    def _next(self) -> bool:
        """Decode the batch in hand once a slot is free, then read the following one; False when done."""
        self.slots.acquire()
        if self.stopping.is_set():
            return False
        with self.side.active():
            out = self.decode(self.next_batch)
            done = self.side.handover()
        self.results.put((out, done))
        if self.stopping.is_set():
            return False
        self.next_batch = next(self.source, _END)
        if self.next_batch is _END:
            self.results.put(_END)
            return False
        return True

    def take(self) -> tuple[torch.Tensor, ...] | None:
        """The next decoded batch, ready for the training stream; None at the end of the pass."""
        item = self.results.get()
        self.slots.release()
        if isinstance(item, _Failed):
            self.thread.join()
            raise item.error
        if item is _END:
            self.thread.join()
            return None
        out: tuple[torch.Tensor, ...] = item[0]
        self.side.receive(item[1], out)
        return out

    def stop(self) -> None:
        self.stopping.set()
        self.slots.release()  # a thread waiting for a slot wakes, sees the stop and ends
        self.thread.join(JOIN_S)
        if self.thread.is_alive():
            log.warning("the decode thread did not end within %.0f s (it waits for the loader); left behind", JOIN_S)
