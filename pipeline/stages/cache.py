"""The cache stage: its input stream is stored once in the catalog and read back ever after."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from ..device import device_description, is_out_of_memory
from ..errors import DeviceMemoryError, StageError
from ..fingerprint import is_cacheable
from ..ops.cache import StoredStream, cache_layout, write_stream
from ..spec import STREAM, Spec
from ..stage import Stage, StageCall, StageInputs

# Lossless codecs each backend has; the first is its default.
COMPRESSORS = {"zarr": ("zstd", "blosc", "none"), "hdf5": ("gzip", "lzf", "none")}
LEVELS = {"zstd": (1, 22), "blosc": (0, 9), "gzip": (0, 9)}


class Cache(Stage):
    """Write-through to the store as sample-chunked zarr v3 or HDF5; later runs read it, no upstream work."""

    type_name: ClassVar[str] = "cache"
    kind: ClassVar[str] = STREAM
    inputs: ClassVar[dict[str, str]] = {"input": STREAM}
    # 2: each split chunked by its own sample size (the chunks a shuffled epoch permutes changed)
    version: ClassVar[int] = 2
    cacheable: ClassVar[bool] = True
    resumable: ClassVar[bool] = True
    # a grown dataset's entry is built from a stored one plus the new samples (pipeline.growth)
    extendable: ClassVar[bool] = True
    # Reading knobs change the order or speed samples are met at, never the stored content.
    fingerprint_exclude: ClassVar[frozenset[str]] = frozenset(
        {"prefetch", "prefetch_max_bytes", "window_chunks", "read_through", "keep_in_memory_bytes",
         "keep_on_device_bytes"}
    )

    input: str
    format: Literal["zarr", "hdf5"] = "zarr"
    chunk_bytes: int = Field(1 << 20, ge=1024, description="target bytes per chunk (~1 MiB suits SD cards)")
    compressor: Literal["zstd", "blosc", "gzip", "lzf", "none"] | None = Field(
        None, description="lossless codec on top of quantization; default zstd (zarr) / gzip (hdf5)"
    )
    level: int = Field(3, ge=0, le=22)
    prefetch: int = Field(2, ge=0, description="chunks read ahead while training")
    prefetch_max_bytes: int | None = Field(None, ge=1, description="cap on the bytes of chunks read ahead")
    window_chunks: int = Field(
        4, ge=1, description="shuffle window in chunks: larger = more random, more memory"
    )
    keep_in_memory_bytes: int = Field(
        128 << 20, ge=0, description="a split whose decoded chunks fit stays in memory after its first "
        "read, so later epochs skip reading and decompressing it (train first, then val); 0: never"
    )
    keep_on_device_bytes: int = Field(
        1 << 30, ge=0, description="run.device cuda: a split whose stored (still packed) chunks fit stays in "
        "GPU memory after its first read, so later epochs copy nothing to the device (train first, then "
        "val; the GPU analogue of keep_in_memory_bytes); 0: never. Ignored on the CPU"
    )
    read_through: Literal["sdcard", "emmc", "ssd"] | None = Field(
        None, description="simulate slow storage when reading (benchmarks, tests); zarr and hdf5"
    )

    @model_validator(mode="after")
    def _codec_fits_backend(self) -> Cache:
        codec = self.codec
        if codec not in COMPRESSORS[self.format]:
            raise ValueError(
                f"compressor {codec!r} is not available for format {self.format!r}; "
                f"expected one of {list(COMPRESSORS[self.format])}"
            )
        lo, hi = LEVELS.get(codec, (0, 22))
        if codec in LEVELS and not lo <= self.level <= hi:
            raise ValueError(f"level {self.level} is out of range for {codec}: expected {lo}..{hi}")
        return self

    @property
    def codec(self) -> str:
        return self.compressor or COMPRESSORS[self.format][0]

    def resolve(self, inputs: StageInputs, ctx: Any) -> Spec:
        # An executor (the recipe's executor.type: dask) builds an entry in several processes at once.
        if self.format == "hdf5" and getattr(ctx, "executor", None) is not None:
            raise StageError(
                "format: hdf5 cannot be built with executor.type: dask (one HDF5 file cannot be written by "
                "several processes); use format: zarr or executor.type: local"
            )
        return inputs["input"]

    def estimate_bytes(self, spec: Spec) -> int | None:
        # Before the lossless codec: an upper bound, which is what a budget check needs.
        return sum(s.num_samples * s.sample_bytes() for s in spec.splits.values())

    def build(self, ctx: Any, inputs: dict[str, Any], staging: Path, call: StageCall) -> dict[str, Any]:
        stream = inputs["input"]
        name = call.name
        total = sum(s.num_samples for s in stream.spec.splits.values())
        # Lineage holds no timestamps: a resumed build must be bit-identical to an uninterrupted one.
        assert call.lineage is not None
        lineage = call.lineage.entry_attrs(stream.spec)
        executor = getattr(ctx, "executor", None)
        extends = getattr(stream, "extends", None)
        if executor is not None and extends is not None:
            ctx.progress.log(f"[{name}] extending {extends[:12]} in this process: only the new samples are "
                             "computed")
        elif executor is not None:
            if is_cacheable(call.fingerprint):
                # Each worker computes and writes its own chunks; the input stream is never pulled here.
                layout = cache_layout(
                    stream.spec,
                    chunk_bytes=self.chunk_bytes,
                    compressor=self.codec,
                    level=self.level,
                    attrs={"lineage": lineage},
                )
                return executor.build_cache(
                    ctx, name=name, fingerprint=call.fingerprint, input_name=self.input, spec=stream.spec,
                    staging=staging, layout=layout,
                )
            # Workers prove they compute the same data by recomputing its fingerprint; an input
            # that cannot be fingerprinted gives them nothing to check against.
            ctx.progress.log(
                f"[{name}] building in this process, not on Dask: its input cannot be fingerprinted, "
                "so workers could not be checked to compute the same data"
            )
        device = getattr(ctx, "torch_device", None)
        try:
            with ctx.progress.bar(total, f"{name}: building cache", unit="img") as bar:
                written = self._write(ctx, stream, staging, call, lineage, bar)
        except RuntimeError as exc:
            if not is_out_of_memory(exc):
                raise
            # Out of memory outside the frozen forward (which names its own stage): the quantizer or
            # a stage between. The staging directory keeps every chunk written so far.
            raise DeviceMemoryError(
                f"stage {name!r} (cache): out of memory on {device or 'the CPU'} while computing its input "
                f"`{self.input}`; set a smaller batch_size on the stages upstream (decode, frozen_forward) "
                "and rerun: the build resumes from the chunks already written"
            ) from None
        if device is not None:
            # Where the entry was computed: lineage for people, never identity (not in the fingerprint).
            written["built_on"] = device_description(device)
        return written

    def _write(self, ctx: Any, stream: Any, staging: Path, call: StageCall, lineage: dict[str, Any],
               bar: Any) -> dict[str, Any]:
        name = call.name
        return write_stream(
            stream,
            staging,
            chunk_bytes=self.chunk_bytes,
            compressor=self.codec,
            level=self.level,
            attrs={"lineage": lineage},
            fmt=self.format,
            progress=bar,
            log=lambda msg: ctx.progress.log(f"[{name}] {msg}"),
            batch_period=call.upstream_of("input").batch_period,
        )

    def load(self, ctx: Any, entry: Any, call: StageCall) -> StoredStream:
        return StoredStream(
            Path(entry.path),
            size_bytes=entry.size_bytes,
            prefetch_depth=self.prefetch,
            window_chunks=self.window_chunks,
            throttle=self.read_through,
            prefetch_max_bytes=self.prefetch_max_bytes,
            keep_in_memory_bytes=self.keep_in_memory_bytes,
            device=getattr(ctx, "torch_device", None),
            keep_on_device_bytes=self.keep_on_device_bytes,
        )
