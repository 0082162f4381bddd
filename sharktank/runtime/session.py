"""A small multi-device runtime session.

Devices are created once and kept for the session's lifetime; results are copied to host
numpy arrays before they are returned, so no device buffer outlives its device.
"""

from __future__ import annotations

import threading
from typing import Callable, Sequence

import numpy as np

__all__ = ["Session", "release_pages", "WORKER_SPIN_US"]

# How long (microseconds) each local-task worker spins for more work before it sleeps. A decode
# step is hundreds of small dispatches in a chain, and a worker put to sleep between two of them
# takes a futex wake and a context switch to come back: the 1B Q4_K-mix decode (509 dispatches)
# took 34.7 against 37.5 ms/token with 25 us (paired 1.065, 6 rounds; 60 us: the same), bfloat16's
# (fewer, larger dispatches) the same either way. Workers spin only right after a task, so an idle
# model costs nothing. 0 turns it off (IREE's default).
WORKER_SPIN_US = 25
_TASK_DRIVERS: dict[int, object] = {}  # local-task drivers (each its own worker pool) per spin


def release_pages(indexes) -> int:
    """Tell the kernel this process no longer needs the resident pages of the parameter
    archives these indexes map (``madvise(MADV_DONTNEED)``); returns the bytes advised.

    The archives are mapped read-only from their files. Module initialisation reads every
    weight once to build the packed copies the kernels use, which leaves the whole file
    resident in this process beside those copies: twice the weight memory. Dropping the
    pages changes no data: a page read again later (an embedding row, a weight used as
    stored) is mapped back from the page cache or the file. Linux only; elsewhere a no-op."""
    return _advise_free(_mapped_spans(indexes))


def _mapped_spans(indexes) -> set[tuple[int, int]]:
    """(address, length) of each archive mapping (every entry of a file shares its mapping)."""
    spans = set()
    for index in indexes:
        for _, entry in index.items():
            if not entry.is_file:
                continue
            handle, _ = entry.file_storage
            if not handle.is_host_allocation:
                continue
            view = np.frombuffer(handle.host_allocation, dtype=np.uint8)
            spans.add((view.ctypes.data, view.nbytes))
    return spans


def _advise_free(spans: set[tuple[int, int]]) -> int:
    import ctypes
    import mmap
    import sys

    if not sys.platform.startswith("linux"):
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    advised = 0
    for address, length in spans:
        start = address - address % mmap.PAGESIZE
        end = address + length
        if libc.madvise(start, end - start, mmap.MADV_DONTNEED) == 0:
            advised += end - start
    return advised


def _task_driver(rt, spin_us: int):
    """A local-task driver whose workers spin ``spin_us`` (one per value, shared by sessions).
    IREE reads the setting from its flags as a driver is created; it is set back after."""
    if spin_us < 0:
        raise ValueError(f"worker_spin_us must be >= 0, found {spin_us}")
    if spin_us not in _TASK_DRIVERS:
        from iree.runtime._binding import create_hal_driver  # uncached, unlike get_driver

        rt.flags.parse_flags(f"--task_worker_spin_us={spin_us}")
        try:
            _TASK_DRIVERS[spin_us] = create_hal_driver("local-task")
        finally:
            rt.flags.parse_flags("--task_worker_spin_us=0")
    return _TASK_DRIVERS[spin_us]


class Session:
    """``device_count`` devices of ``driver`` and one compiled module."""

    def __init__(
        self,
        vmfb: bytes | str,
        device_count: int,
        driver: str = "local-task",
        parameters: dict[str, list[str]] | None = None,
        worker_spin_us: int = WORKER_SPIN_US,
    ):
        """``vmfb``: module bytes or a path (mapped); ``parameters``: scope -> archive paths
        (all archives of a scope go into one index, as IREE searches one provider per scope);
        ``worker_spin_us``: local-task only, see :data:`WORKER_SPIN_US`."""
        import iree.runtime as rt

        self._rt = rt
        self.instance = rt.VmInstance()
        drv = _task_driver(rt, worker_spin_us) if driver == "local-task" else rt.get_driver(driver)
        # get_device() is cached and would hand back one device N times: create each one.
        self.devices = [drv.create_default_device() for _ in range(device_count)]
        modules = [rt.create_hal_module(self.instance, devices=self.devices)]
        self._indexes = []
        if parameters:
            providers = []
            for scope, files in parameters.items():
                index = rt.ParameterIndex()
                for f in files:
                    index.load(str(f))
                self._indexes.append(index)
                providers.append(index.create_provider(scope=scope))
            modules.append(rt.create_io_parameters_module(self.instance, *providers))
        if isinstance(vmfb, (bytes, bytearray)):
            self.module = rt.VmModule.copy_buffer(self.instance, vmfb)
        else:
            self.module = rt.VmModule.mmap(self.instance, str(vmfb))
        self.context = rt.VmContext(self.instance, modules=[*modules, self.module])

    def settle(self, call: Callable[[], object], every_s: float = 0.02) -> None:
        """Run ``call`` (a first function call: it waits for the module's initialisation)
        on a worker thread while the mapped archives' pages are released every ``every_s``
        seconds, and once after (:func:`release_pages`).

        A module compiled with asynchronous initialisation (the CPU target's) returns from
        loading at once and packs its weights on IREE's threads; releasing the pages that
        packing has read as it goes keeps the raw archives from becoming resident beside the
        packed copies, so the peak memory is about one copy of the weights, not two."""
        done = threading.Event()
        failure: list[BaseException] = []

        def run():
            try:
                call()
            except BaseException as e:  # re-raised on the calling thread
                failure.append(e)
            finally:
                done.set()

        spans = _mapped_spans(self._indexes)  # found once; the loop only advises
        worker = threading.Thread(target=run, name="first-call", daemon=True)
        worker.start()
        while not done.wait(every_s):
            _advise_free(spans)
        worker.join()
        _advise_free(spans)
        if failure:
            raise failure[0]

    def place(self, array: np.ndarray, device: int, element_type=None):
        """A device array of ``array`` on logical device ``device`` (``element_type``: an
        ``iree.runtime.HalElementType`` for dtypes numpy lacks, e.g. bfloat16 from uint16 bits)."""
        rt = self._rt
        dev = self.devices[device]
        array = np.ascontiguousarray(array)
        if element_type is None:
            return rt.asdevicearray(dev, array)
        # asdevicearray ignores element_type (it maps the numpy dtype), so allocate directly.
        view = dev.allocator.allocate_buffer_copy(
            memory_type=rt.MemoryType.DEVICE_LOCAL,
            allowed_usage=rt.BufferUsage.DEFAULT | rt.BufferUsage.MAPPING,
            device=dev,
            buffer=array,
            element_type=element_type,
        )
        return rt.DeviceArray(dev, view, override_dtype=array.dtype)

    def invoke(self, function: str, inputs: Sequence) -> list:
        """Call ``function`` on device arrays; returns device arrays (kept on their devices)."""
        fn = self.module.lookup_function(function)
        if fn is None:
            raise KeyError(f"module has no function {function!r}")
        res = self._rt.FunctionInvoker(self.context, self.devices[0], fn)(*inputs)
        return list(res) if isinstance(res, (list, tuple)) else [res]

    def call(self, function: str, inputs: Sequence[np.ndarray], devices: Sequence[int]) -> list[np.ndarray]:
        """Call ``function`` with ``inputs[i]`` placed on logical device ``devices[i]``."""
        if len(inputs) != len(devices):
            raise ValueError(f"{len(inputs)} inputs but {len(devices)} devices")
        res = self.invoke(function, [self.place(a, d) for a, d in zip(inputs, devices)])
        return [np.array(r.to_host()) for r in res]
