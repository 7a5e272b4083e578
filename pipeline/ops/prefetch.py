"""Bounded background prefetch: keep slow producers (storage, decode) busy while compute runs.

A thread fills a queue of at most ``depth`` items; torch and zarr release the GIL
in their heavy parts, so producer and consumer genuinely overlap. Errors in the
producer are re-raised in the consumer, and abandoning the iterator (break,
exception, Ctrl-C) stops the thread instead of leaving it blocked on a full queue.
Prefetches chain: ``prefetch(decode(prefetch(fetch(...))))`` runs storage reads and
decoding on two threads, each stage bounded by its own queue, and stopping the outer
one stops the inner one.

:class:`EpochPrefetch` runs one prefetch through a trainer's successive epochs, so the
next epoch's first batches are prepared while the current one ends.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")

_DONE = object()
# Marks the threads prefetch runs producers on: work done there is already off the consumer's thread.
_role = threading.local()


def on_prefetch_thread() -> bool:
    """True on a thread that :func:`prefetch` runs a producer on (a stage that would otherwise
    schedule work "between the consumer's steps" is then not on the consumer's thread at all)."""
    return getattr(_role, "producer", False)


class _Failure:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class _Producer:
    """The thread and bounded queue behind :func:`prefetch`: runs from construction until :meth:`close`."""

    def __init__(self, items: Iterable[object], depth: int, name: str) -> None:
        self.q: queue.Queue[object] = queue.Queue(maxsize=depth)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._produce, args=(items,), name=name, daemon=True)
        self.thread.start()

    def _put(self, item: object) -> bool:
        """Queue ``item``; False once the consumer has gone (the producer then stops)."""
        while not self.stop.is_set():
            try:
                self.q.put(item, timeout=0.1)
                return not self.stop.is_set()
            except queue.Full:
                continue
        return False

    def _produce(self, items: Iterable[object]) -> None:
        _role.producer = True
        try:
            for item in items:
                if not self._put(item):
                    return
            self._put(_DONE)
        except BaseException as exc:  # forwarded to the consumer, which re-raises it
            self._put(_Failure(exc))
        finally:
            # Close a generator source now, on this thread, so a chained prefetch (fetch ->
            # decode -> consumer) stops its own thread too instead of waiting for the GC.
            close = getattr(items, "close", None)
            if close is not None:
                close()

    def items(self) -> Iterator[object]:
        while True:
            item = self.q.get()
            if item is _DONE:
                return
            if isinstance(item, _Failure):
                raise item.exc
            yield item

    def close(self) -> None:
        self.stop.set()
        # Empty the queue: a producer blocked on a full queue wakes now (not at its next
        # timeout), sees ``stop`` and returns; it does not start another item.
        while True:
            try:
                self.q.get_nowait()
            except queue.Empty:
                break
        self.thread.join(timeout=5)


def prefetch(items: Iterable[T], depth: int = 2, *, name: str = "prefetch") -> Iterator[T]:
    if depth <= 0:
        yield from items
        return
    producer = _Producer(items, depth, name)  # the thread starts at the first next()
    try:
        yield from producer.items()  # type: ignore[misc]
    finally:
        producer.close()


class StartedPrefetch(Iterator[T]):
    """:func:`prefetch` whose thread starts now, not at the first ``next()``: for reading ahead of a
    consumer that will come later. :meth:`close` stops it even if it was never iterated."""

    def __init__(self, items: Iterable[T], depth: int, *, name: str) -> None:
        self._producer = _Producer(items, max(1, depth), name)
        self._items = self._producer.items()

    def __next__(self) -> T:
        try:
            return next(self._items)  # type: ignore[return-value]
        except BaseException:  # exhausted or failed: the thread has nothing more to do
            self.close()
            raise

    def close(self) -> None:
        self._producer.close()


_END_OF_EPOCH = object()


def _epochs(open_epoch: Callable[[int], Iterable[T]], epochs: int) -> Iterator[object]:
    """Every epoch's items in turn, each epoch followed by an end marker."""
    for epoch in range(epochs):
        items = open_epoch(epoch)
        try:
            yield from items
        finally:
            close = getattr(items, "close", None)  # stops the epoch's own reader threads
            if close is not None:
                close()
        yield _END_OF_EPOCH


class EpochPrefetch:
    """A trainer's epochs of batches from one background thread that runs across epoch ends.

    ``open_epoch(e)`` gives epoch ``e``'s batches; opening, reading, decoding and augmenting
    all run on the thread. As soon as epoch ``e``'s last batch is queued the thread opens
    ``e + 1``, so its first batches (often the slowest: a shuffle window has to fill first)
    are ready while the trainer works through ``e``'s last ``depth`` batches and evaluates.
    At most ``depth`` batches wait at any time, across the boundary too. Epochs are taken in
    order, each to its end; leaving one early, an error, or :meth:`close` stops the thread.
    ``depth`` 0 opens each epoch when it is asked for, on the caller's thread.
    """

    def __init__(
        self, open_epoch: Callable[[int], Iterable[T]], epochs: int, depth: int, *, name: str = "epochs"
    ) -> None:
        self._items = prefetch(_epochs(open_epoch, epochs), depth, name=name)
        self._next = 0
        self._epochs = epochs
        self._closed = False

    def epoch(self, epoch: int) -> Iterator[T]:
        if self._closed:
            raise ValueError(f"epoch {epoch} asked for after the prefetch was closed (an epoch left early?)")
        if epoch != self._next or epoch >= self._epochs:
            raise ValueError(
                f"epochs are prefetched in order, 0 to {self._epochs - 1}: asked for epoch {epoch}, "
                f"next is {self._next}"
            )
        self._next += 1
        return self._take()

    def _take(self) -> Iterator[T]:
        finished = False
        try:
            for item in self._items:  # a ``for`` that returns early leaves the prefetch running
                if item is _END_OF_EPOCH:
                    finished = True
                    return
                yield item  # type: ignore[misc]
        finally:
            if not finished:  # the rest of the epoch would be the next epoch's start
                self.close()

    def close(self) -> None:
        """Stop the background thread (and the open epoch's readers); idempotent."""
        self._closed = True
        self._items.close()  # type: ignore[attr-defined]
