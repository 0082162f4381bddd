"""The MLIR forms whose spelling differs between the IREE releases the kernels meet, each
written here once; everything else the emitter (:mod:`.mlir`) writes is stable syntax.

- A slice of a 1-D vector is written as a ``vector.shuffle`` of the one source:
  ``vector.extract_strided_slice``'s attribute form (``{offsets = [..], sizes = .., strides
  = ..}``) is what IREE 3.10 parses and 3.13 rejects (``expected 'offsets'``), while 3.13's
  form (``offsets = [..], sizes = ..`` without braces) is rejected by 3.10. Both parse the
  shuffle, and a 1-D strided slice lowers to the same LLVM ``shufflevector``.
- ``vector.extract`` of a scalar names its result and source type (``: f32 from
  vector<2xf32>``), the form since LLVM 19.
- ``vpdpbusd``, ``vdpbf16ps``, ``vcvtne2ps2bf16`` and AVX2's ``vpmaddubsw``/``vpmaddwd`` are
  LLVM intrinsic calls: MLIR's x86vector dialect is not in IREE's compiler.
"""

from __future__ import annotations

__all__ = ["bf16_dot", "bf16_round", "extract", "int8_dot", "madd_bytes", "madd_words", "slice_1d"]


def slice_1d(source: str, source_type: str, offset: int, size: int) -> str:
    """The op taking lanes ``offset .. offset + size`` of the 1-D vector ``source``."""
    lanes = ", ".join(str(offset + i) for i in range(size))
    return f"vector.shuffle {source}, {source} [{lanes}] : {source_type}, {source_type}"


def transfer_read(mem: str, indices: list[str], pad: str, mem_type: str, type_: str) -> str:
    """The op reading ``type_`` (a 1-D vector) at ``indices`` of ``mem``, lanes out of bounds
    taking ``pad``."""
    return f"vector.transfer_read {mem}[{', '.join(indices)}], {pad} {{in_bounds = [false]}} : {mem_type}, {type_}"


def extract(source: str, source_type: str, position: int, elem: str) -> str:
    """The op taking lane ``position`` of the 1-D vector ``source`` as a scalar ``elem``."""
    return f"vector.extract {source}[{position}] : {elem} from {source_type}"


def int8_dot(acc: str, unsigned: str, signed: str) -> str:
    """``vpdpbusd`` (AVX512-VNNI): ``acc`` (vector<16xi32>) plus, in lane i, the sum of the
    products of bytes 4i..4i+3 of ``unsigned`` (vector<64xi8> read as uint8) and ``signed``."""
    return (f'llvm.call_intrinsic "llvm.x86.avx512.vpdpbusd.512"({acc}, {unsigned}, {signed}) : '
            "(vector<16xi32>, vector<64xi8>, vector<64xi8>) -> vector<16xi32>")


def madd_bytes(unsigned: str, signed: str) -> str:
    """``vpmaddubsw`` (AVX2): lane i (vector<16xi16>) is the saturated sum of the products of
    bytes 2i, 2i+1 of ``unsigned`` (vector<32xi8> read as uint8) and ``signed``."""
    return (f'llvm.call_intrinsic "llvm.x86.avx2.pmadd.ub.sw"({unsigned}, {signed}) : '
            "(vector<32xi8>, vector<32xi8>) -> vector<16xi16>")


def madd_words(a: str, b: str) -> str:
    """``vpmaddwd`` (AVX2): lane i (vector<8xi32>) is ``a[2i] * b[2i] + a[2i+1] * b[2i+1]`` of
    the vector<16xi16> ``a`` and ``b``."""
    return (f'llvm.call_intrinsic "llvm.x86.avx2.pmadd.wd"({a}, {b}) : '
            "(vector<16xi16>, vector<16xi16>) -> vector<8xi32>")


def bf16_dot(acc: str, a: str, b: str) -> str:
    """``vdpbf16ps`` (AVX512-BF16): ``acc`` (vector<16xf32>) plus, in lane i, ``a[2i] * b[2i] +
    a[2i+1] * b[2i+1]`` of the vector<32xbf16> ``a`` and ``b``, the products exact and summed in
    float32."""
    return (f'llvm.call_intrinsic "llvm.x86.avx512bf16.dpbf16ps.512"({acc}, {a}, {b}) : '
            "(vector<16xf32>, vector<32xbf16>, vector<32xbf16>) -> vector<16xf32>")


def bf16_round(high: str, low: str) -> str:
    """``vcvtne2ps2bf16`` (AVX512-BF16): the vector<16xf32> ``low`` then ``high`` rounded to
    bfloat16 (to nearest even), as one vector<32xbf16>: lanes 0-15 from ``low``."""
    return (f'llvm.call_intrinsic "llvm.x86.avx512bf16.cvtne2ps2bf16.512"({high}, {low}) : '
            "(vector<16xf32>, vector<16xf32>) -> vector<32xbf16>")
