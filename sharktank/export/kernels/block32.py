"""What the legacy 32-value layouts' kernels (Q4_0, Q4_1, Q5_0, Q5_1) share: their values
are 4 bits in 16 bytes (low nibbles: values 0-15, high nibbles: 16-31), Q5's with a fifth bit
per value from 4 more bytes, and a block's 32 values are ``d * q`` (Q4_0, Q5_0, q signed) or
``d * q + m`` (Q4_1, Q5_1), formed once in float32 and multiplied with every row of float x,
as Q8_0's kernel does (:mod:`.q8_0`).
"""

from __future__ import annotations

from .product_dispatch import Block
from .mlir import Value, vector

__all__ = ["affine_product", "fifth_bits", "nibbles", "signed_byte"]

_V32 = vector(32, "i8")


def nibbles(blk: Block, offset: int) -> Value:
    """(vector<32xi8>) the 4-bit values of the 16 bytes at ``offset``, in value order."""
    e, v16 = blk.e, vector(16, "i8")
    packed = blk.byte(offset, 16)
    low = e.binary("arith.andi", packed, e.const(15, v16), "lo")
    high = e.binary("arith.shrui", packed, e.const(4, v16), "hi")
    return e.shuffle(low, high, range(32), "q")


def signed_byte(bits: int) -> int:
    """An 8-bit pattern as the signed i8 literal MLIR takes."""
    return bits - 256 if bits > 127 else bits


def fifth_bits(blk: Block, offset: int) -> Value:
    """(vector<32xi8>) 16 where value i's fifth bit is set, else 0: bit ``i % 8`` of byte ``i
    // 8`` of the 4 bytes at ``offset`` (bit i of their little-endian word)."""
    e = blk.e
    packed = blk.byte(offset, 4, "qh")
    spread = e.shuffle(packed, packed, [i // 8 for i in range(32)], "qh")
    bits = e.binary("arith.andi", spread, e.const([signed_byte(1 << (i % 8)) for i in range(32)], _V32), "qh")
    is_set = e.cmp("arith.cmpi", "ne", bits, e.const(0, _V32), "set")
    return e.select(is_set, e.const(16, _V32), e.const(0, _V32), "q5")


def affine_product(blk: Block, q: Value, signed: bool, d: Value, m: Value | None = None) -> None:
    """Every row's accumulator += ``d * q (+ m)`` (``q``: vector<32xi8>, ``signed`` or not)
    times x's 32 values at the block."""
    e, acc = blk.e, blk.acc
    qf = e.cast("arith.sitofp" if signed else "arith.uitofp", q, acc, "qf")
    dv = e.broadcast(d, acc, "d")
    values = e.binary("arith.mulf", qf, dv, "wv") if m is None else e.fma(qf, dv, e.broadcast(m, acc, "m"), "wv")
    blk.accumulate(values, 0)
