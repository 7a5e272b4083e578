"""Progress bars for anything long: on for a terminal, off when piped or with ``--quiet``."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tqdm import tqdm

# Used when the terminal does not say how wide it is: a serial console, or `docker run -t`, whose
# pseudo-terminal reports 0 columns until a client resizes it. tqdm then draws no bar at all.
FALLBACK_COLUMNS = 80


def terminal_columns(stream: Any) -> int:
    """The width of the terminal ``stream`` writes to; ``COLUMNS`` or 80 when it reports none (0)."""
    try:
        columns = os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):  # no fileno (a wrapper), not a terminal, closed
        columns = 0
    if columns <= 0:
        try:
            columns = int(os.environ.get("COLUMNS", ""))
        except ValueError:
            columns = 0
    return columns if columns > 0 else FALLBACK_COLUMNS


class Progress:
    def __init__(self, *, quiet: bool = False, stream: Any = None) -> None:
        self.stream = stream or sys.stderr
        self.quiet = quiet
        self.enabled = not quiet and hasattr(self.stream, "isatty") and self.stream.isatty()

    @contextmanager
    def bar(self, total: int | None, desc: str, unit: str = "it") -> Iterator[tqdm]:
        # The width is read once per bar (bars are per epoch or per build), so a terminal that
        # reports 0 columns gets a usable width instead of tqdm's dynamic 0.
        from tqdm import tqdm  # here, not at import: recipes validate where only pyyaml and pydantic are

        ncols = terminal_columns(self.stream) if self.enabled else None
        bar = tqdm(total=total, desc=desc, unit=unit, disable=not self.enabled, file=self.stream,
                   leave=False, ncols=ncols, dynamic_ncols=False)
        try:
            yield bar
        finally:
            bar.close()

    def log(self, message: str) -> None:
        """One line of progress for a non-terminal (logs) too, unless quiet."""
        if not self.quiet:
            # A bar on this terminal is drawn in place: write the line above it, not through it.
            if self.enabled:
                from tqdm import tqdm

                tqdm.write(message, file=self.stream)
                self.stream.flush()
            else:
                print(message, file=self.stream, flush=True)
