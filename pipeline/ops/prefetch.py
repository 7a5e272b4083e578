"""Bounded background prefetch: keep slow producers (storage, decode) busy while compute runs.

A thread fills a queue of at most ``depth`` items; torch and zarr release the GIL
in their heavy parts, so producer and consumer genuinely overlap. Errors in the
producer are re-raised in the consumer, and abandoning the iterator (break,
exception, Ctrl-C) stops the thread instead of leaving it blocked on a full queue.
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
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
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
        thread.join(timeout=5)
