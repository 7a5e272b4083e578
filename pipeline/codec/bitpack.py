"""Bit-packing of n-bit codes (n in 1, 2, 4, 8) into bytes: the on-disk layout of quantized features.

Format (version 1; ``tests/codec/test_bitpack.py`` pins it with golden bytes):

- each row of ``L`` codes becomes ``packed_length(L, bits) = ceil(L * bits / 8)`` bytes, rows independent;
- code ``i`` of a row goes to byte ``i * bits // 8``, at bit offset ``(i * bits) % 8`` counted from the
  least significant bit (little-endian bit order: the first code of a byte is in its low bits);
- unused high bits of the last byte of a row are zero.

So with 2 bits, codes ``[0, 1, 2, 3]`` pack into the single byte ``0b11_10_01_00 = 0xE4``.

Implementation: instead of one strided tensor op per bit position on small uint8 slices, rows are
viewed as int64 words of 8 codes (one per byte) and compacted SWAR-style ("SIMD within a register"):
three rounds of shift / or / mask, each halving the number of fields per word, leave the word's
``8 * bits`` packed bits in its low bits. Unpacking runs the same rounds backwards. Each round is one
vectorized pass over ``L / 8`` words, so packing costs a handful of passes over 1/8 of the data. The
word view relies on the host being little-endian (x86, ARM); on a big-endian host the plain per-slice
implementation is used instead, which produces the same bytes.
"""

from __future__ import annotations

import sys

import torch

VALID_BITS = (1, 2, 4, 8)

_LITTLE_ENDIAN = sys.byteorder == "little"
# Narrow integer type holding the 8 * bits packed bits of one word (8 codes) after compaction.
_WORD_DTYPE = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def check_bits(bits: int) -> int:
    """``bits`` if it is a supported code width, else a ValueError naming the valid set."""
    if isinstance(bits, bool) or bits not in VALID_BITS:
        raise ValueError(f"bits must be one of {VALID_BITS}, got {bits!r}")
    return int(bits)


def packed_length(n_elements: int, bits: int) -> int:
    """Bytes needed for ``n_elements`` codes of ``bits`` bits: ``ceil(n_elements * bits / 8)``."""
    check_bits(bits)
    if n_elements < 0:
        raise ValueError(f"n_elements must be >= 0, got {n_elements}")
    return (n_elements * bits + 7) // 8


def _mask(stride: int, width: int) -> int:
    """A 64-bit mask with ``width`` low bits set in every ``stride``-bit field."""
    field = (1 << width) - 1
    return sum(field << s for s in range(0, 64, stride))


def _rounds(bits: int) -> tuple[tuple[int, int, int], ...]:
    """(shift, coarse mask, fine mask) of each compaction round.

    A round merges neighbouring fields of ``width`` bits spaced ``stride`` bits apart into fields of
    ``2 * width`` bits spaced ``2 * stride`` apart: ``w = (w | w >> shift) & coarse``. Unpacking undoes
    it with ``w = (w | w << shift) & fine``. Fields never overlap because ``width <= stride / 2``.
    """
    out = []
    stride, width = 8, bits
    while stride < 64:
        out.append((stride - width, _mask(2 * stride, 2 * width), _mask(stride, width)))
        stride, width = 2 * stride, 2 * width
    return tuple(out)


_ROUNDS = {b: _rounds(b) for b in (1, 2, 4)}


def _check_2d(t: torch.Tensor, name: str) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype != torch.uint8:
        found = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a 2-D uint8 tensor (N, L), found {found}")


def _padded(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` (N, L) uint8 as a contiguous (N, width) tensor, zero-padded on the right; no copy if possible."""
    n, length = t.shape
    if length == width and t.stride() == (width, 1) and t.storage_offset() % 8 == 0:
        return t  # rows dense and word-aligned: the int64 word view works in place
    out = t.new_zeros((n, width))
    out[:, :length] = t
    return out


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 ``codes`` (N, L), each ``< 2**bits``, into uint8 (N, ``packed_length(L, bits)``).

    Codes are not range-checked (that would cost a full pass): a code ``>= 2**bits`` corrupts its
    neighbours. ``bits == 8`` returns ``codes`` itself when it is already contiguous.
    """
    bits = check_bits(bits)
    _check_2d(codes, "codes")
    n, length = codes.shape
    plen = packed_length(length, bits)
    if bits == 8:
        return codes.contiguous()
    if n == 0 or length == 0:
        return codes.new_zeros((n, plen))
    if not _LITTLE_ENDIAN:
        return pack_reference(codes, bits)
    words = (length + 7) // 8
    w = _padded(codes, 8 * words).view(torch.int64)  # (N, words), 8 codes per word, code i in byte i
    (shift, coarse, _), *rest = _ROUNDS[bits]
    acc = w >> shift  # out of place: w may alias the caller's codes
    acc |= w
    acc &= coarse
    for shift, coarse, _ in rest:
        acc |= acc >> shift
        acc &= coarse
    out = acc.to(_WORD_DTYPE[bits]).view(torch.uint8)  # (N, words * bits), little-endian bytes
    return out if out.shape[1] == plen else out[:, :plen].contiguous()


def unpack(packed: torch.Tensor, bits: int, n_elements: int) -> torch.Tensor:
    """Inverse of :func:`pack`: uint8 (N, ``packed_length(n_elements, bits)``) -> uint8 (N, n_elements)."""
    bits = check_bits(bits)
    _check_2d(packed, "packed")
    n, plen = packed.shape
    if plen != packed_length(n_elements, bits):
        raise ValueError(f"packed rows must have packed_length({n_elements}, {bits}) = "
                         f"{packed_length(n_elements, bits)} bytes, found {plen}")
    if bits == 8:
        return packed.contiguous()
    if n == 0 or n_elements == 0:
        return packed.new_zeros((n, n_elements))
    if not _LITTLE_ENDIAN:
        return unpack_reference(packed, bits, n_elements)
    words = (n_elements + 7) // 8
    dtype = _WORD_DTYPE[bits]
    src = _padded(packed, words * bits)
    w = src.view(dtype).to(torch.int64)  # (N, words); int16/int32 sign-extend, masked below
    if bits != 1:
        w &= (1 << (8 * bits)) - 1
    for shift, _, fine in reversed(_ROUNDS[bits]):
        w |= w << shift
        w &= fine
    out = w.view(torch.uint8)  # (N, 8 * words)
    return out if out.shape[1] == n_elements else out[:, :n_elements].contiguous()


def pack_reference(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Straightforward packing, one op per bit position; the specification the fast path is tested against."""
    bits = check_bits(bits)
    _check_2d(codes, "codes")
    n, length = codes.shape
    per = 8 // bits
    plen = packed_length(length, bits)
    v = _padded(codes, plen * per).reshape(n, plen, per)
    out = v[:, :, 0].clone()
    for j in range(1, per):
        out |= v[:, :, j] << (j * bits)
    return out


def unpack_reference(packed: torch.Tensor, bits: int, n_elements: int) -> torch.Tensor:
    """Straightforward unpacking (broadcast shift and mask); see :func:`pack_reference`."""
    bits = check_bits(bits)
    _check_2d(packed, "packed")
    n, plen = packed.shape
    per = 8 // bits
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    out = (packed[:, :, None] >> shifts) & ((1 << bits) - 1)
    return out.reshape(n, plen * per)[:, :n_elements].contiguous()
