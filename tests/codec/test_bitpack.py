"""Bit-packing: exact round trips, exact sizes, and the on-disk byte layout pinned by golden bytes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.codec.bitpack import (
    VALID_BITS,
    pack,
    pack_reference,
    packed_length,
    unpack,
    unpack_reference,
)

# Format version 1: code i of a row sits in byte i*bits//8 at bit offset (i*bits)%8 from the least
# significant bit. If one of these fails, the on-disk format changed: caches written before the change
# no longer decode. Change the expected bytes only together with a format version bump.
GOLDEN = {
    1: ([[1, 0, 1, 1, 0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0, 0, 0, 1]],
        [[0x8D, 0x03], [0x00, 0x02]]),
    2: ([[0, 1, 2, 3, 3, 2, 1, 0, 1], [3, 3, 3, 3, 0, 0, 0, 0, 2]],
        [[0xE4, 0x1B, 0x01], [0xFF, 0x00, 0x02]]),
    4: ([[1, 2, 15, 0, 10], [0, 0, 0, 0, 15]],
        [[0x21, 0x0F, 0x0A], [0x00, 0x00, 0x0F]]),
    8: ([[0, 127, 255], [1, 2, 3]],
        [[0x00, 0x7F, 0xFF], [0x01, 0x02, 0x03]]),
}
# 21 codes: two full 8-code words and a partial one, so the word-at-a-time path and its tail are pinned.
GOLDEN_LONG = {
    1: ([(i * 7 + i // 3) % 2 for i in range(21)], [0x92, 0x24, 0x09]),
    2: ([(i * 5 + 1) % 4 for i in range(21)], [0x39, 0x39, 0x39, 0x39, 0x39, 0x01]),
    4: ([(i * 11 + 3) % 16 for i in range(21)],
        [0xE3, 0x49, 0xAF, 0x05, 0x6B, 0xC1, 0x27, 0x8D, 0xE3, 0x49, 0x0F]),
}


def u8(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.uint8)


@pytest.mark.parametrize("bits", VALID_BITS)
def test_golden_bytes(bits: int) -> None:
    codes, expected = GOLDEN[bits]
    packed = pack(u8(codes), bits)
    assert packed.tolist() == expected
    assert unpack(u8(expected), bits, len(codes[0])).tolist() == codes


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_golden_bytes_across_words(bits: int) -> None:
    codes, expected = GOLDEN_LONG[bits]
    assert pack(u8([codes]), bits).tolist() == [expected]
    assert pack_reference(u8([codes]), bits).tolist() == [expected]
    assert unpack(u8([expected]), bits, len(codes)).tolist() == [codes]


def test_packed_length() -> None:
    assert packed_length(0, 1) == 0
    assert packed_length(1, 1) == 1
    assert packed_length(8, 1) == 1
    assert packed_length(9, 1) == 2
    assert packed_length(3, 2) == 1
    assert packed_length(5, 2) == 2
    assert packed_length(3, 4) == 2
    assert packed_length(96 * 14 * 14, 2) == 96 * 14 * 14 // 4
    assert packed_length(7, 8) == 7


@given(n=st.integers(0, 4), length=st.integers(0, 150), bits=st.sampled_from(VALID_BITS),
       seed=st.integers(0, 2**31 - 1))
@settings(max_examples=150, deadline=None)
def test_round_trip_exact(n: int, length: int, bits: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (n, length), dtype=torch.uint8, generator=g)
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape == (n, packed_length(length, bits))  # exactly `bits` bits per code, no byte per value
    assert torch.equal(packed, pack_reference(codes, bits))
    assert torch.equal(unpack(packed, bits, length), codes)
    assert torch.equal(unpack_reference(packed, bits, length), codes)
    if n and length and (length * bits) % 8:  # padding bits of the last byte are zero
        assert int((packed[:, -1] >> ((length * bits) % 8)).max()) == 0


@pytest.mark.parametrize("bits", VALID_BITS)
def test_extreme_codes(bits: int) -> None:
    top = torch.full((3, 37), 2**bits - 1, dtype=torch.uint8)
    assert torch.equal(unpack(pack(top, bits), bits, 37), top)
    assert int(pack(top, bits)[:, :-1].min()) == 255


@pytest.mark.parametrize("bits", VALID_BITS)
def test_views_and_offsets(bits: int) -> None:
    """Non-contiguous inputs and views at odd storage offsets pack like their contiguous copies."""
    base = torch.randint(0, 2**bits, (5, 41), dtype=torch.uint8)
    views = (base[1:4, 1:], base[:, ::2], base.t().contiguous().t()[:, :40], base[0:1, :40], base[0:1, :16])
    for view in views:
        packed = pack(view, bits)
        assert torch.equal(packed, pack(view.contiguous(), bits))
        assert torch.equal(unpack(packed, bits, view.shape[1]), view)
        assert torch.equal(unpack(packed[1:], bits, view.shape[1]), view[1:])
    packed = torch.randint(0, 256, (5, 41), dtype=torch.uint8)
    for view in (packed[0:1, : 8 * bits], packed[1:3, 1 : 1 + 8 * bits], packed[0:1, :bits]):
        length = view.shape[1] * 8 // bits
        assert torch.equal(unpack(view, bits, length), unpack(view.contiguous(), bits, length))


def test_pack_does_not_modify_input() -> None:
    codes = torch.randint(0, 2, (2, 64), dtype=torch.uint8)
    before = codes.clone()
    pack(codes, 1)
    assert torch.equal(codes, before)


@pytest.mark.parametrize("bad", [0, 3, 5, 16, 32, True])
def test_bad_bits(bad: int) -> None:
    codes = torch.zeros(1, 8, dtype=torch.uint8)
    for call in (lambda: pack(codes, bad), lambda: unpack(codes, bad, 8), lambda: packed_length(8, bad)):
        with pytest.raises(ValueError, match=r"bits must be one of \(1, 2, 4, 8\)"):
            call()


def test_bad_shapes() -> None:
    with pytest.raises(ValueError, match="2-D uint8"):
        pack(torch.zeros(8, dtype=torch.uint8), 2)
    with pytest.raises(ValueError, match="2-D uint8"):
        pack(torch.zeros(1, 8, dtype=torch.int64), 2)
    with pytest.raises(ValueError, match=r"packed_length\(9, 2\) = 3 bytes, found 2"):
        unpack(torch.zeros(1, 2, dtype=torch.uint8), 2, 9)
