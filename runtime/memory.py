"""Per-rank peak memory: the CUDA allocator's counters, or live tensor bytes on the CPU.

On CUDA, ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` after
``torch.cuda.reset_peak_memory_stats``.

On the CPU there is no caching allocator to ask, so ``LiveStorageTracker`` (a
``TorchDispatchMode``) counts the bytes of every tensor storage created while it is active and
drops them when the storage is freed (a ``weakref`` callback); ``UntypedStorage.resize_`` is
patched while tracking because FSDP2 frees and re-allocates unsharded parameters that way. The
same method as ``torch.distributed._tools.mem_tracker.MemTracker`` (which agrees with it to
the byte, shared/notes/torch-distributed-on-cpu.md) without its per-module bookkeeping. Not
seen: temporaries that a tensor subclass (DTensor) allocates inside its own dispatch, and
allocations on non-Python threads (gloo's workers); both are transient. Reserved bytes on the
CPU are reported equal to allocated bytes; the process's peak RSS is reported beside them.
"""

from __future__ import annotations

import resource
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

_KIB = 1024


def _storages(tensor: torch.Tensor) -> list[torch.UntypedStorage]:
    """Untyped storages behind ``tensor``, looking through wrapper subclasses (DTensor)."""
    if is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        inner = (getattr(tensor, name) for name in names)
        return [s for t in inner if isinstance(t, torch.Tensor) for s in _storages(t)]
    if tensor.device.type == "meta":
        return []
    return [tensor.untyped_storage()]


class _Entry:
    __slots__ = ("nbytes",)

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes


class LiveStorageTracker(TorchDispatchMode):
    """Live and peak bytes of tensor storages created under this dispatch mode."""

    def __init__(self) -> None:
        super().__init__()
        self._entries: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._refs: set[weakref.ref] = set()
        self.live_bytes = 0
        self.peak_bytes = 0
        self._original_resize = None
        self._depth = 0

    def track(self, tensor: torch.Tensor) -> None:
        """Count ``tensor``'s storages from now on (idempotent)."""
        for storage in _storages(tensor):
            if storage in self._entries:
                continue
            entry = self._register(storage, storage.nbytes())
            self._add(entry.nbytes)

    def _register(self, storage: torch.UntypedStorage, nbytes: int) -> _Entry:
        entry = _Entry(nbytes)
        self._entries[storage] = entry

        def freed(ref: weakref.ref, entry: _Entry = entry) -> None:
            self._refs.discard(ref)
            self._free(entry)

        self._refs.add(weakref.ref(storage, freed))
        return entry

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    def _add(self, nbytes: int) -> None:
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _free(self, entry: _Entry) -> None:
        self.live_bytes -= entry.nbytes
        entry.nbytes = 0

    def _resized(self, storage: torch.UntypedStorage, size: int) -> None:
        entry = self._entries.get(storage)
        if entry is None:
            entry = self._register(storage, 0)
        self._add(size - entry.nbytes)
        entry.nbytes = size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):  # most ops: skip flattening a one-tensor result
            self.track(out)
            return out
        for item in tree_flatten(out)[0]:
            if isinstance(item, torch.Tensor):
                self.track(item)
        return out

    def __enter__(self):
        # re-entered where dispatch modes are off (a tensor subclass's op handler computing on
        # its local tensors) it pushes the mode again; storage resizes are hooked once
        self._depth += 1
        if self._depth == 1:
            original = torch.UntypedStorage.resize_
            self._original_resize = original

            def resize_(storage, size):
                result = original(storage, size)
                self._resized(storage, size)
                return result

            torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        self._depth -= 1
        if self._depth == 0:
            torch.UntypedStorage.resize_ = self._original_resize
        return super().__exit__(*exc)


class PeakMemory:
    """Peak allocated / reserved bytes of this rank since ``reset``, on CUDA or CPU.

    Use as a context around everything to be counted (model construction included, so the
    CPU tracker knows every persistent storage); call ``reset`` where the window starts.
    ``cpu_tracking=False`` skips the CPU tracker (its dispatch overhead slows small steps);
    the peaks are then None on the CPU. ``stop_cpu_tracking`` leaves the tracker part way:
    the peak so far is kept, later ops run without its overhead.
    """

    def __init__(self, device: torch.device, *, cpu_tracking: bool = True) -> None:
        self.device = device
        self._cuda = device.type == "cuda"
        self._tracker = LiveStorageTracker() if not self._cuda and cpu_tracking else None
        self._stopped = False

    def __enter__(self) -> "PeakMemory":
        if self._tracker is not None:
            self._tracker.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._tracker is not None and not self._stopped:
            self._tracker.__exit__(*exc)

    @property
    def cpu_tracking(self) -> bool:
        """Whether the CPU tracker counts this rank's ops now (its dispatch overhead is on)."""
        return self._tracker is not None and not self._stopped

    def stop_cpu_tracking(self) -> None:
        """Leave the CPU tracker: ``peak_bytes`` keeps the peak counted so far, the current
        bytes read None from now on. Call it where the tracker's mode is the innermost one
        (between steps). Nothing on CUDA, whose counters cost nothing."""
        if self.cpu_tracking:
            self._stopped = True
            self._tracker.__exit__(None, None, None)

    @property
    def tracker(self) -> LiveStorageTracker | None:
        """The CPU live-tensor tracker (None on CUDA or with ``cpu_tracking=False``)."""
        return self._tracker

    @property
    def source(self) -> str:
        """What the peaks measure: ``cuda-allocator``, ``cpu-live-tensors`` or ``off``."""
        if self._cuda:
            return "cuda-allocator"
        return "cpu-live-tensors" if self._tracker is not None else "off"

    def reset(self) -> None:
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.cpu_tracking:
            self._tracker.reset_peak()

    @property
    def peak_bytes(self) -> int | None:
        if self._cuda:
            return int(torch.cuda.max_memory_allocated(self.device))
        return int(self._tracker.peak_bytes) if self._tracker is not None else None

    @property
    def allocated_bytes(self) -> int | None:
        """Bytes allocated now (CUDA allocator, or live tensors on the CPU; None when off)."""
        if self._cuda:
            return int(torch.cuda.memory_allocated(self.device))
        return int(self._tracker.live_bytes) if self.cpu_tracking else None

    @property
    def reserved_bytes(self) -> int | None:
        """Bytes the CUDA caching allocator holds now (on the CPU: ``allocated_bytes``)."""
        if self._cuda:
            return int(torch.cuda.memory_reserved(self.device))
        return self.allocated_bytes

    @property
    def peak_reserved_bytes(self) -> int | None:
        if self._cuda:
            return int(torch.cuda.max_memory_reserved(self.device))
        return self.peak_bytes


_PEAK_BEFORE_RESET = 0
"""The peak resident set size before ``RssGrowth`` reset the kernel's high-water mark."""


def peak_rss_bytes() -> int:
    """This process's peak resident set size (Linux reports ``ru_maxrss`` in KiB)."""
    return max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * _KIB, _PEAK_BEFORE_RESET)


def _status_bytes(field: str) -> int | None:
    """A ``/proc/self/status`` memory field (``VmRSS``, ``VmHWM``) in bytes; None off Linux."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * _KIB
    except OSError:
        return None
    return None


class RssGrowth:
    """How far this process's resident memory rose above its level at entry while the block
    ran (``growth_bytes``): the peak inside the block minus the RSS at entry. Linux resets
    the peak mark for this (``echo 5 > /proc/self/clear_refs``; ``peak_rss_bytes`` still
    reports the whole process's peak); None where that is not possible. In a worker forked
    from the preloaded server (``prefork.py``) the growth also counts shared-library code the
    block runs for the first time in that process (a fork does not copy the page tables of
    file mappings): several MiB that a worker of its own interpreter counted at import."""

    growth_bytes: int | None = None

    def __enter__(self) -> "RssGrowth":
        global _PEAK_BEFORE_RESET
        _PEAK_BEFORE_RESET = peak_rss_bytes()
        self._start = _status_bytes("VmRSS")
        try:
            with open("/proc/self/clear_refs", "w") as refs:
                refs.write("5")
            self._reset = self._start is not None
        except OSError:
            self._reset = False
        return self

    def __exit__(self, *exc) -> None:
        peak = _status_bytes("VmHWM") if self._reset else None
        self.growth_bytes = peak - self._start if peak is not None else None
