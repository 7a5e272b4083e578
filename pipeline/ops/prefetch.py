"""Bounded background prefetch: keep slow producers (storage, decode) busy while compute runs.

A thread fills a queue of at most ``depth`` items; torch and zarr release the GIL
in their heavy parts, so producer and consumer genuinely overlap. Errors in the
producer are re-raised in the consumer, and abandoning the iterator (break,
exception, Ctrl-C) stops the thread instead of leaving it blocked on a full queue.
Prefetches chain: ``prefetch(decode(prefetch(fetch(...))))`` runs storage reads and
decoding on two threads, each stage bounded by its own queue, and stopping the outer
one stops the inner one.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")

_DONE = object()


class _Failure:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


def prefetch(items: Iterable[T], depth: int = 2, *, name: str = "prefetch") -> Iterator[T]:
    if depth <= 0:
        yield from items
        return
    q: queue.Queue[object] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item: object) -> bool:
        """Queue ``item``; False once the consumer has gone (the producer then stops)."""
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return not stop.is_set()
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in items:
                if not put(item):
                    return
            put(_DONE)
        except BaseException as exc:  # forwarded to the consumer, which re-raises it
            put(_Failure(exc))
        finally:
            # Close a generator source now, on this thread, so a chained prefetch (fetch ->
            # decode -> consumer) stops its own thread too instead of waiting for the GC.
            close = getattr(items, "close", None)
            if close is not None:
                close()

    thread = threading.Thread(target=produce, name=name, daemon=True)
    thread.start()
    try:
        while True:
            item = q.get()
            if item is _DONE:
                return
            if isinstance(item, _Failure):
                raise item.exc
            yield item  # type: ignore[misc]
    finally:
        stop.set()
        # Empty the queue: a producer blocked on a full queue wakes now (not at its next
        # timeout), sees ``stop`` and returns; it does not start another item.
        while True:
            try:
                q.get_nowait()
            except queue.Empty:
                break
        thread.join(timeout=5)
