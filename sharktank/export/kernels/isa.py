"""Which x86 instructions the hand-written kernels are written with: read once from the host's
``/proc/cpuinfo`` (the kernels are compiled for the exporting host's CPU), or chosen for a
block of code with :func:`using` (tests write every form on any host).

- ``int8_dot``: the unsigned-by-signed byte dot product of the int16-x kernels
  (:func:`.syntax.int8_dot`). ``"avx512_vnni"``: ``vpdpbusd``, 64 products an instruction.
  ``"avx2"``: ``vpmaddubsw`` then ``vpmaddwd`` on 32-byte halves (AMD Zen 2/3, Intel client
  CPUs without AVX512), exact because every kernel's unsigned bytes are below 128 (weight
  values of at most 6 bits), so that the 16-bit pair sums cannot saturate. None: no kernel
  that needs it (those layouts keep the torch form).
- ``bf16_dot``: the prefill dispatches' bfloat16 pair product (:func:`.syntax.bf16_dot`).
  ``"avx512_bf16"``: ``vdpbf16ps``. ``"avx2"`` (with FMA): the pairs widened to float32 and
  two ``vfmadd`` (:meth:`.mlir.Emitter.bf16_dot`). None: prompts keep the dense product.

A kernel's MLIR depends on the form, so the generators' caches are keyed on it
(:func:`cached`).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Callable, Iterator, TypeVar

__all__ = ["Isa", "HOST", "cached", "current", "using", "host_flags"]

INT8_DOTS = ("avx512_vnni", "avx2")
BF16_DOTS = ("avx512_bf16", "avx2")


@dataclass(frozen=True)
class Isa:
    """The instruction forms a kernel is written with (None: not available)."""

    int8_dot: str | None = None
    bf16_dot: str | None = None

    def __post_init__(self):
        if self.int8_dot not in (None, *INT8_DOTS):
            raise ValueError(f"int8_dot: expected one of {INT8_DOTS} or None, found {self.int8_dot!r}")
        if self.bf16_dot not in (None, *BF16_DOTS):
            raise ValueError(f"bf16_dot: expected one of {BF16_DOTS} or None, found {self.bf16_dot!r}")

    @property
    def vector_bytes(self) -> int:
        """The width of the vector registers the kernels are written for: 64 with an AVX512
        form, 32 (AVX2's) otherwise."""
        return 64 if "avx512" in f"{self.int8_dot} {self.bf16_dot}" else 32

    @classmethod
    def of_flags(cls, flags: list[set[str]]) -> "Isa":
        """The forms every one of these processors' feature flags allows (none for no processor)."""

        def everywhere(flag: str) -> bool:
            return bool(flags) and all(flag in f for f in flags)

        int8 = next((form for form in INT8_DOTS if everywhere(form)), None)
        bf16 = next((form for form in BF16_DOTS if everywhere(form) and (form != "avx2" or everywhere("fma"))), None)
        return cls(int8, bf16)


def host_flags() -> list[set[str]]:
    """Each processor's feature flags as ``/proc/cpuinfo`` lists them; none where it cannot be
    read (or another architecture's file, which says ``Features``)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    return [set(line.partition(":")[2].split()) for line in lines if line.split(":")[0].strip() == "flags"]


HOST = Isa.of_flags(host_flags())
# What current() answers: a plain module dict, which torch.export's tracing reads (it cannot
# trace a ContextVar's get), set by using() for the length of a block on one thread.
_STATE: dict[str, Isa] = {"isa": HOST}


def current() -> Isa:
    """The forms the kernels written now take: :data:`HOST`, or what :func:`using` set."""
    return _STATE["isa"]


@contextlib.contextmanager
def using(isa: Isa) -> Iterator[Isa]:
    """Write (and choose) the kernels with ``isa``'s forms inside the block. A module written
    so runs only on a CPU with those instructions."""
    before, _STATE["isa"] = _STATE["isa"], isa
    try:
        yield isa
    finally:
        _STATE["isa"] = before


F = TypeVar("F", bound=Callable)


def cached(fn: F) -> F:
    """``functools.cache`` of a generator, keyed on :func:`current` as well as its arguments."""

    @functools.cache
    def by_isa(isa: Isa, *args, **kwargs):
        return fn(*args, **kwargs)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return by_isa(current(), *args, **kwargs)

    return wrapper  # type: ignore[return-value]
