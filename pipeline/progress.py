"""Progress bars for anything long: on for a terminal, off when piped or with ``--quiet``."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tqdm import tqdm


class Progress:
    def __init__(self, *, quiet: bool = False, stream: Any = None) -> None:
        self.stream = stream or sys.stderr
        self.quiet = quiet
        self.enabled = not quiet and hasattr(self.stream, "isatty") and self.stream.isatty()

    @contextmanager
    def bar(self, total: int | None, desc: str, unit: str = "it") -> Iterator[tqdm]:
        bar = tqdm(total=total, desc=desc, unit=unit, disable=not self.enabled, file=self.stream,
                   leave=False, dynamic_ncols=True)
        try:
            yield bar
        finally:
            bar.close()

    def log(self, message: str) -> None:
        """One line of progress for a non-terminal (logs) too, unless quiet."""
        if not self.quiet:
            print(message, file=self.stream, flush=True)
