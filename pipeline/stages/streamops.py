"""Generic stream operators as recipe stages: rechunk, prefetch, shuffle."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import Field

from ..ops.batching import Batch, rechunk
from ..ops.prefetch import prefetch
from ..ops.shuffle import window_shuffle
from ..spec import STREAM, Spec
from ..stage import Stage, StageCall, StageInputs
from ..stream import Stream, StreamStats

if TYPE_CHECKING:
    from ..context import RunContext


class OpStream(Stream):
    def __init__(self, parent: Stream, op: Any) -> None:
        self.parent, self.op, self.spec, self.stats = parent, op, parent.spec, StreamStats()

    def open(self, split: str, *, epoch: int = 0, shuffle: bool = False, seed: int = 0,
             start: int = 0) -> Iterator[Batch]:
        batches = self.parent.open(split, epoch=epoch, shuffle=shuffle, seed=seed, start=start)
        return self.op(batches, split, epoch, seed, shuffle)

    def stored_bytes(self) -> int:
        return self.parent.stored_bytes()


class _OpStage(Stage):
    kind: ClassVar[str] = STREAM
    inputs: ClassVar[dict[str, str]] = {"input": STREAM}
    input: str

    def resolve(self, inputs: StageInputs, ctx: RunContext) -> Spec:
        return inputs["input"]

    def sample_dependence(self) -> str | None:
        # Batching, reading ahead and (training passes only) shuffling leave a written stream's samples
        # as they are, in order.
        return None


class Rechunk(_OpStage):
    """Change the batch size mid-stream; every sample exactly once, order unchanged."""

    type_name: ClassVar[str] = "rechunk"
    fingerprint_exclude: ClassVar[frozenset[str]] = frozenset({"batch_size", "drop_last"})
    batch_size: int = Field(..., ge=1)
    drop_last: bool = False

    def sample_dependence(self) -> str | None:
        if self.drop_last:
            return "drop_last drops the samples of a short last batch, which depend on the others"
        return None

    def run(self, ctx: RunContext, inputs: dict[str, Any], call: StageCall) -> OpStream:
        size, drop_last = self.batch_size, self.drop_last
        return OpStream(inputs["input"], lambda it, *_: rechunk(it, size, drop_last=drop_last))


class Prefetch(_OpStage):
    """Keep ``depth`` batches ready on a background thread."""

    type_name: ClassVar[str] = "prefetch"
    fingerprint_exclude: ClassVar[frozenset[str]] = frozenset({"depth"})
    depth: int = Field(2, ge=0)

    def run(self, ctx: RunContext, inputs: dict[str, Any], call: StageCall) -> OpStream:
        label = f"prefetch-{call.name}"
        return OpStream(inputs["input"], lambda it, *_: prefetch(it, self.depth, name=label))


class Shuffle(_OpStage):
    """Shuffle within a window of ``buffer`` samples (training passes only)."""

    type_name: ClassVar[str] = "shuffle"
    fingerprint_exclude: ClassVar[frozenset[str]] = frozenset({"buffer", "batch_size"})
    buffer: int = Field(1024, ge=1)
    batch_size: int = Field(64, ge=1)

    def run(self, ctx: RunContext, inputs: dict[str, Any], call: StageCall) -> OpStream:
        def op(it: Iterator[Batch], split: str, epoch: int, seed: int, shuffle: bool) -> Iterator[Batch]:
            if not shuffle:
                return it
            return window_shuffle(it, self.buffer, seed=seed * 7919 + epoch + 1, out_size=self.batch_size)

        return OpStream(inputs["input"], op)
