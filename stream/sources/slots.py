"""Slot rings: one live feed's frame buffers, allocated once by the engine process and written by a decode
worker process (stream/sources/live_workers.py).

A ring is `slots` model-input rows ([1, 3, H, W] in the model's dtype), one frame each. The engine process
allocates it and hands a worker a picklable `RingSpec`; the worker maps the same memory, decodes and
converts a frame straight into a free slot, and sends a small record naming the slot. The engine reads the
slot in place (stacked into the inference batch) and tells the worker when it is free again.

Decision record:
- Host rings are a file under /dev/shm (the temp folder where there is none or it is full: its space is
  reserved up front, so a full /dev/shm is an error at allocation, not a SIGBUS later) mapped by both processes: plain
  mmap, not multiprocessing.shared_memory, whose resource tracker (Python 3.11/3.12) unlinks a segment that a
  child process attached to when that child exits, which is exactly what a restarted worker must not do.
  The engine unlinks the file when the feed ends.
- Device rings are one plain `cudaMalloc` allocation per feed and route (not CuPy's stream-ordered pool:
  an IPC handle names a whole allocation), exported once with `cudaIpcGetMemHandle`; a worker opens it once
  with `cudaIpcOpenMemHandle` and writes rows with its own kernels on its own CUDA stream. It synchronizes
  that stream before it sends a slot's record (a few microseconds after the row kernel; an interprocess
  event per slot would save that wait at the cost of an event handle per record), so the engine reads a
  slot only once it is written.
- A ring outlives its workers: a worker that dies leaves the memory with the engine, which gives the slots
  the dead worker held to the one that replaces it.
"""

from __future__ import annotations

import mmap
import os
import tempfile
from dataclasses import dataclass
from typing import Any

import numpy as np

from stream.engines.model import ModelInfo


@dataclass(frozen=True)
class RingSpec:
    """What a worker needs to map a ring: where it is and its shape."""

    kind: str  # "host" or "device"
    slots: int
    shape: tuple[int, int, int]  # 3, H, W
    dtype: str
    path: str = ""  # host: the mapped file
    handle: bytes = b""  # device: the cudaIpcMemHandle
    device_id: int = 0

    @property
    def row_bytes(self) -> int:
        c, h, w = self.shape
        return c * h * w * np.dtype(self.dtype).itemsize

    @property
    def nbytes(self) -> int:
        return self.slots * self.row_bytes


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def _reserve(prefix: str, nbytes: int) -> tuple[int, str]:
    """A file of `nbytes` with its space reserved (posix_fallocate: a full /dev/shm fails here, not later as
    a SIGBUS in a worker writing a slot), in /dev/shm, else in the temp folder."""
    errors = []
    for folder in dict.fromkeys([_shm_dir(), tempfile.gettempdir()]):
        fd, path = tempfile.mkstemp(prefix=prefix, dir=folder)
        try:
            os.posix_fallocate(fd, 0, nbytes)
            return fd, path
        except OSError as exc:
            os.close(fd)
            os.unlink(path)
            errors.append(f"{folder}: {exc.strerror or exc}")
    raise OSError(f"no room for {nbytes / 1e6:.1f} MB of frame slots ({'; '.join(errors)})")


class HostRing:
    """A host ring the engine owns: `view(slot)` is a [1, 3, H, W] numpy view of one slot."""

    def __init__(self, info: ModelInfo, slots: int, tag: str = "feed") -> None:
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in tag)[:40]
        shape = (3, info.height, info.width)
        nbytes = slots * int(np.prod(shape)) * np.dtype(info.dtype).itemsize
        fd, path = _reserve(f"stream-{os.getpid()}-{safe}-", nbytes)
        self.spec = RingSpec("host", slots, shape, str(np.dtype(info.dtype)), path=path)
        try:
            self._map = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        self.array = _rows(np.frombuffer(self._map, dtype=self.spec.dtype), self.spec)

    def view(self, slot: int) -> np.ndarray:
        return self.array[slot : slot + 1]

    def close(self) -> None:
        try:
            os.unlink(self.spec.path)
        except FileNotFoundError:
            pass
        self.array = None  # type: ignore[assignment]
        try:
            self._map.close()
        except BufferError:  # a view is still held somewhere: the mapping goes with it
            pass


class DeviceRing:
    """A device ring the engine owns: one cudaMalloc allocation, exported once through CUDA IPC."""

    def __init__(self, info: ModelInfo, slots: int, device_id: int = 0) -> None:
        import cupy as cp

        self._cp = cp
        shape = (3, info.height, info.width)
        nbytes = slots * int(np.prod(shape)) * np.dtype(info.dtype).itemsize
        with cp.cuda.Device(device_id):
            self._ptr = cp.cuda.runtime.malloc(nbytes)
            handle = bytes(cp.cuda.runtime.ipcGetMemHandle(self._ptr))
            cp.cuda.runtime.memset(self._ptr, 0, nbytes)
        self.spec = RingSpec("device", slots, shape, str(np.dtype(info.dtype)), handle=handle, device_id=device_id)
        self.array = _device_rows(cp, self._ptr, self.spec, owner=self)

    def view(self, slot: int) -> Any:
        return self.array[slot : slot + 1]

    def close(self) -> None:
        if self._ptr:
            ptr, self._ptr = self._ptr, 0
            self.array = None
            with self._cp.cuda.Device(self.spec.device_id):
                self._cp.cuda.runtime.free(ptr)


class MappedRing:
    """A ring as a worker maps it (host or device): `view(slot)` as above; `close()` unmaps it."""

    def __init__(self, spec: RingSpec) -> None:
        self.spec = spec
        self._map: mmap.mmap | None = None
        self._ptr = 0
        if spec.kind == "host":
            fd = os.open(spec.path, os.O_RDWR)
            try:
                self._map = mmap.mmap(fd, spec.nbytes)
            finally:
                os.close(fd)
            self.array: Any = _rows(np.frombuffer(self._map, dtype=spec.dtype), spec)
        else:
            import cupy as cp

            self._cp = cp
            with cp.cuda.Device(spec.device_id):
                self._ptr = cp.cuda.runtime.ipcOpenMemHandle(spec.handle)
            self.array = _device_rows(cp, self._ptr, spec, owner=self)

    def view(self, slot: int) -> Any:
        return self.array[slot : slot + 1]

    def close(self) -> None:
        self.array = None
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                pass
            self._map = None
        if self._ptr:
            ptr, self._ptr = self._ptr, 0
            with self._cp.cuda.Device(self.spec.device_id):
                self._cp.cuda.runtime.ipcCloseMemHandle(ptr)


def _rows(flat: np.ndarray, spec: RingSpec) -> np.ndarray:
    return flat.reshape((spec.slots, *spec.shape))


def _device_rows(cp: Any, ptr: int, spec: RingSpec, owner: object) -> Any:
    mem = cp.cuda.UnownedMemory(ptr, spec.nbytes, owner, device_id=spec.device_id)
    return cp.ndarray((spec.slots, *spec.shape), dtype=np.dtype(spec.dtype), memptr=cp.cuda.MemoryPointer(mem, 0))


def make_ring(kind: str, info: ModelInfo, slots: int, *, tag: str = "feed", device_id: int = 0) -> Any:
    """A HostRing or DeviceRing of `slots` rows for `info`'s input."""
    if kind == "host":
        return HostRing(info, slots, tag)
    return DeviceRing(info, slots, device_id)
