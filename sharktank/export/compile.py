"""Compiling multi-device MLIR with the IREE compiler (in-process)."""

from __future__ import annotations

import contextlib
import re
import sys
from dataclasses import dataclass

__all__ = ["TARGETS", "Target", "QUANTIZED_FLAGS", "compile_flags", "compile_mlir", "drop_known_noise"]


@dataclass(frozen=True)
class Target:
    device: str  # IREE device name; one `device[i]` flag per logical device
    driver: str  # IREE runtime driver that runs it by default
    arch_flag: str | None  # flag that takes --target-arch
    default_arch: str | None
    base_flags: tuple[str, ...] = ()
    other_drivers: tuple[str, ...] = ()  # drivers that also run its modules

    @property
    def drivers(self) -> tuple[str, ...]:
        """Every runtime driver that runs this target's modules, the default first."""
        return (self.driver, *self.other_drivers)


TARGETS: dict[str, Target] = {
    # Data tiling packs weights for the CPU's vector units at compile time: toy-llama-3l in
    # float16 decodes 3x and prefills 7x faster than without it (local-sync on 2 cores: 0.39
    # against 1.31 ms per token, 1.4 against 10.3 ms for 8 tokens), for ~3 s more compile.
    # The global-optimization path: IREE 3.10's newer dispatch-creation path (what
    # --iree-opt-data-tiling picks) miscompiles attention written as products (logits off
    # by ~6 for toy-llama-3l; see ops.attention_as_matmuls).
    "cpu": Target(
        "local",
        "local-task",
        "--iree-llvmcpu-target-cpu",
        "host",
        (
            "--iree-hal-local-target-device-backends=llvm-cpu",
            "--iree-opt-level=O3",
            "--iree-global-opt-data-tiling",
            # O3's aggressive fusion with data tiling fails to compile a pipeline stage's last
            # block in 3.10 ("write affecting operations on global resources ...").
            "--iree-dispatch-creation-enable-aggressive-fusion=false",
            # No DWARF in the kernels: 10-15% less compile time, a quarter smaller module.
            "--iree-llvmcpu-debug-symbols=false",
            # Loading returns at once and the weights are packed on the runtime's threads,
            # so the runtime can drop the archive pages packing has read as it goes
            # (Session.settle): about one resident copy of the weights instead of two.
            "--iree-scheduling-initialization-mode=async",
        ),
        # local-sync runs every dispatch on the calling thread: faster for small models.
        other_drivers=("local-sync",),
    ),
    # iree-base-compiler 3.10 takes --iree-hip-target (it rejects --iree-rocm-target).
    "hip": Target("hip", "hip", "--iree-hip-target", "gfx942"),
    "cuda": Target("cuda", "cuda", "--iree-cuda-target", "sm_80"),
}


# For models with quantized weights: IREE hoists constant expressions of parameters into
# globals computed at load, and a weight's dequantization is one, so without this every
# quantized weight would become a float32 global (4x the bfloat16 bytes, 3.8x Q8_0's). A limit
# of 0 bytes of growth keeps dequantization in the kernels, while packing that does not grow
# a weight is still hoisted; plain models do not get it (padded packs would stop being hoisted).
QUANTIZED_FLAGS = ("--iree-opt-const-expr-max-size-increase-threshold=0",)


def compile_flags(device_count: int, target: str = "cpu", target_arch: str | None = None, extra: tuple[str, ...] = ()) -> list[str]:
    """Compiler flags: one ``--iree-hal-target-device=<dev>[i]`` per logical device.

    The ``[i]`` ordinal matters: without it the compiler merges identical devices into one.
    """
    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}; expected one of {sorted(TARGETS)}")
    if device_count < 1:
        raise ValueError(f"device_count must be >= 1, found {device_count}")
    t = TARGETS[target]
    flags = ["--iree-input-type=torch", *t.base_flags]
    flags += [f"--iree-hal-target-device={t.device}[{i}]" for i in range(device_count)]
    arch = target_arch or t.default_arch
    if t.arch_flag and arch:
        flags.append(f"{t.arch_flag}={arch}")
    return flags + list(extra)


def compile_mlir(mlir: str, device_count: int, target: str = "cpu", target_arch: str | None = None, extra: tuple[str, ...] = ()) -> bytes:
    """Compile MLIR text to a VM flatbuffer for ``device_count`` logical devices. The
    compiler's messages go to stderr, less the known spurious one (:func:`drop_known_noise`)."""
    import io

    import iree.compiler as ic

    buffer = io.StringIO()
    try:
        with contextlib.redirect_stderr(buffer):
            return ic.compile_str(mlir, extra_args=compile_flags(device_count, target, target_arch, extra))
    finally:
        sys.stderr.write(drop_known_noise(buffer.getvalue()))


# IREE 3.10 in asynchronous initialisation mode (the CPU target's) reports each parameter the
# program reads as stored rather than through a packed copy (the embedding table) with
# "error: immutable global '@...__timepoint' is initialized both by initial value and by store
# in initializer", plus the source line and a caret, and compiles on. The modules are right
# (every compiled path is compared with eager torch in the tests), and on the CPU such a
# parameter is mapped from its archive before the first call, so nothing can read it early.
_NOISE = re.compile(r"^.*error: immutable global '@[^']*__timepoint' is initialized both by initial value and by store in initializer\n(?:.*\n)?(?:\s*\^\s*\n)?", re.M)


def drop_known_noise(text: str) -> str:
    """``text`` without the spurious IREE 3.10 timepoint diagnostic (see above)."""
    return _NOISE.sub("", text)
