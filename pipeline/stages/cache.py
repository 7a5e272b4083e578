"""The cache stage: its input stream is stored once in the catalog and read back ever after."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field

from ..ops.cache import StoredStream, chunk_samples_for, write_stream
from ..registry import register
from ..spec import STREAM, Spec
from ..stage import Stage


@register
class Cache(Stage):
    """Write-through to the store as sample-chunked zarr v3; later runs read it without upstream work."""

    type_name: ClassVar[str] = "cache"
    kind: ClassVar[str] = STREAM
    inputs: ClassVar[dict[str, str]] = {"input": STREAM}
    cacheable: ClassVar[bool] = True
    # Reading knobs change the order samples are met in, never the stored content.
    fingerprint_exclude: ClassVar[frozenset[str]] = frozenset({"prefetch", "window_chunks"})

    input: str
    chunk_bytes: int = Field(1 << 20, ge=1024, description="target bytes per chunk (~1 MiB suits SD cards)")
    compressor: Literal["zstd", "blosc", "none"] = "zstd"
    level: int = Field(3, ge=0, le=22)
    prefetch: int = Field(2, ge=0, description="chunks read ahead while training")
    window_chunks: int = Field(4, ge=1, description="shuffle window in chunks: larger = more random")

    def resolve(self, inputs: dict[str, Spec], ctx: Any) -> Spec:
        return inputs["input"]

    def estimate_bytes(self, spec: Spec) -> int | None:
        return sum(s.num_samples * s.sample_bytes() for s in spec.splits.values())

    def build(self, ctx: Any, inputs: dict[str, Any], staging: Path, name: str) -> dict[str, Any]:
        stream = inputs["input"]
        total = sum(s.num_samples for s in stream.spec.splits.values())
        lineage = {"stage": name, "fingerprint": ctx.fingerprints.get(name), "recipe": ctx.recipe_name,
                   "meta": dict(stream.spec.meta)}
        with ctx.progress.bar(total, f"{name}: building cache", unit="img") as bar:
            return write_stream(stream, staging / "data.zarr", chunk_bytes=self.chunk_bytes,
                                compressor=self.compressor, level=self.level, attrs={"lineage": lineage},
                                progress=bar)

    def load(self, ctx: Any, entry: Any, name: str) -> StoredStream:
        return StoredStream(Path(entry.path) / "data.zarr", size_bytes=entry.size_bytes,
                            prefetch_depth=self.prefetch, window_chunks=self.window_chunks)

    def chunk_samples(self, spec: Spec) -> int:
        return chunk_samples_for(spec, self.chunk_bytes)
