"""Device-only collectives on the CPU: the test mode that makes gloo refuse host tensors, as NCCL does.

NCCL accepts CUDA tensors only; a tensor the runtime forgot to put on its device (a step timer
made with ``torch.tensor(seconds)``, a metric built from Python floats) ends a GPU run at its
first collective. On a CPU-only machine every tensor is a CPU tensor, so gloo accepts all of
them and such a bug passes every test. This module restores the distinction on the CPU: with
``MESHPLAN_STRICT_COLLECTIVES=1`` (``ENV``) each worker tracks which tensors would be *host*
tensors on a GPU and every collective refuses them with one ``HostTensorInCollective`` line.

What counts as a host tensor (mirroring where a CUDA run would put it):

* made by a factory (``torch.tensor``, ``torch.zeros``, ``torch.from_numpy``, ...) without a
  ``device=`` argument, or with the *string* ``"cpu"``;
* the result of ``Tensor.cpu()``, ``.pin_memory()``, ``.numpy``-style round trips, or ``.to("cpu")``
  (the string again), and of any out-of-place op whose tensor inputs are all host tensors.

A ``torch.device`` object, as the runtime passes its rank device around (``device=device``,
``x.to(device)``, ``device=inputs.device``), makes a device tensor. So the runtime's code can
name host memory only by the string ``"cpu"`` (offload buffers, checkpoint staging) and its
device only through the device object: the same code is then right on CUDA. Where a placement
change returns its input unchanged (everything is on the CPU), the call returns an alias
instead (same storage, no copy), so the input keeps its own placement, as on a GPU.
Not seen: ``torch.from_numpy`` and the legacy constructors (``torch.LongTensor(...)``), which
bypass torch's function overrides; their results count as device tensors.

How: a ``TorchFunctionMode`` (``HostTracker``) sees every torch call of the process at the
Python level and keeps the host tensors in a weak set; the public collectives of
``torch.distributed`` (``dist.all_reduce``, ``dist.broadcast``, ``dist.all_gather_into_tensor``,
``dist.batch_isend_irecv``, ...; also what FSDP2, DDP's Python side, ZeRO and the pipeline
schedules call) and the functional collectives (``torch.ops._c10d_functional``, used by
DTensor) check their tensor arguments first. It costs a few microseconds per torch call.
Collectives issued from C++ (DDP's reducer buckets) are not seen; they only ever carry
parameters and gradients.

torch APIs: ``torch.overrides.TorchFunctionMode``; the registry of process-group backends
(``torch.distributed.Backend.register_backend``) would need a C++ backend to see device
types other than the CPU's, which is why the check sits in front of gloo instead.
"""

from __future__ import annotations

import functools
import os
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d
from torch.overrides import TorchFunctionMode

ENV = "MESHPLAN_STRICT_COLLECTIVES"
"""Set to 1 to run the workers with device-only collectives (the runtime tests do)."""

HOST = "cpu"
"""The device string that names host memory in strict mode (a torch.device names the rank's)."""

_FACTORIES = frozenset({
    torch.tensor, torch.as_tensor, torch.asarray, torch.from_numpy, torch.frombuffer,
    torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.range,
    torch.linspace, torch.logspace, torch.eye, torch.rand, torch.randn, torch.randint,
    torch.randperm, torch.scalar_tensor, torch.empty_strided,
})
_TO_HOST = frozenset({torch.Tensor.cpu, torch.Tensor.pin_memory})
_COLLECTIVES = (
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor",
    "all_gather_coalesced", "reduce_scatter", "reduce_scatter_tensor", "broadcast", "reduce",
    "send", "recv", "isend", "irecv", "all_to_all", "all_to_all_single", "scatter", "gather",
    "batch_isend_irecv",
)
_OBJECT_COLLECTIVES = ("all_gather_object", "broadcast_object_list", "gather_object",
                       "scatter_object_list", "send_object_list", "recv_object_list")
"""Pickle-carrying collectives: they put their bytes on the group's own device (the CPU for
gloo, the current CUDA device for NCCL) themselves, so they are not checked inside."""
_FUNCTIONAL_NAMESPACES = frozenset({"_c10d_functional", "_c10d_functional_autograd", "c10d"})


class HostTensorInCollective(RuntimeError):
    """A collective was handed a host tensor (NCCL would refuse it)."""


def enabled(env: dict[str, str] | None = None) -> bool:
    """True when ``MESHPLAN_STRICT_COLLECTIVES`` asks for device-only collectives."""
    return (os.environ if env is None else env).get(ENV, "0") not in ("", "0")


def _tensors(value: Any) -> Iterable[torch.Tensor]:
    """The tensors of an argument: a tensor, a list/tuple of them, or a ``dist.P2POp``."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dist.P2POp):
        yield value.tensor


def _device_arg(args: tuple, kwargs: dict) -> Any:
    """The device a ``Tensor.to`` call names (None when it only changes the dtype)."""
    if "device" in kwargs:
        return kwargs["device"]
    for arg in args[1:]:
        if isinstance(arg, (str, torch.device)):
            return arg
        if isinstance(arg, torch.Tensor):  # .to(other): other's placement
            return arg
    return None


class _IdSet:
    """A weak set of tensors by identity (``weakref.WeakSet`` compares with ``==``, which a
    tensor answers elementwise)."""

    def __init__(self) -> None:
        self._refs: dict[int, weakref.ref] = {}

    def __len__(self) -> int:
        return len(self._refs)

    def __contains__(self, tensor: torch.Tensor) -> bool:
        ref = self._refs.get(id(tensor))
        return ref is not None and ref() is tensor

    def add(self, tensor: torch.Tensor) -> None:
        key = id(tensor)
        self._refs[key] = weakref.ref(tensor, lambda _, key=key: self._refs.pop(key, None))

    def discard(self, tensor: torch.Tensor) -> None:
        if tensor in self:
            del self._refs[id(tensor)]


class HostTracker(TorchFunctionMode):
    """Keeps the set of host tensors (module docstring) up to date on every torch call."""

    def __init__(self) -> None:
        super().__init__()
        self.host = _IdSet()
        self.exempt = 0

    def is_host(self, tensor: torch.Tensor) -> bool:
        return tensor in self.host

    def check(self, where: str, args: Iterable[Any]) -> None:
        """Raise ``HostTensorInCollective`` when an argument holds a host tensor."""
        if self.exempt:
            return
        for arg in args:
            for tensor in _tensors(arg):
                if tensor in self.host:
                    raise HostTensorInCollective(
                        f"{where} got a host (CPU) tensor of shape {tuple(tensor.shape)} and "
                        f"dtype {tensor.dtype}; NCCL accepts only device tensors: create it "
                        f"on the rank's device ({ENV}=1)")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        namespace = getattr(func, "namespace", None)
        if namespace in _FUNCTIONAL_NAMESPACES:
            self.check(f"torch.ops.{namespace}.{func.__name__}", (*args, *kwargs.values()))
        out = func(*args, **kwargs)
        if func in _FACTORIES:
            device = kwargs.get("device")
            if device is None or device == HOST:
                self._mark(out)
        elif func in _TO_HOST:
            out = self._fresh(args, out)
            self._mark(out)
        elif func is torch.Tensor.to:
            out = self._fresh(args, out)
            self._moved(args, kwargs, out)
        elif self.host and not getattr(func, "__name__", "").endswith("_"):
            self._propagate(args, kwargs, out)
        return out

    @staticmethod
    def _fresh(args: tuple, out: Any) -> Any:
        """``out``, or an alias of it where a placement change returned its input (already on
        the CPU): on a GPU it would be a new tensor, and the input keeps its own placement."""
        if args and out is args[0]:
            return torch.ops.aten.alias.default(out)
        return out

    def _mark(self, out: Any) -> None:
        for tensor in _tensors(out):
            self.host.add(tensor)

    def _unmark(self, out: Any) -> None:
        for tensor in _tensors(out):
            self.host.discard(tensor)

    def _moved(self, args: tuple, kwargs: dict, out: Any) -> None:
        device = _device_arg(args, kwargs)
        if device is None:  # a dtype change keeps the placement
            self._propagate(args, kwargs, out)
        elif isinstance(device, torch.Tensor):
            if device in self.host:
                self._mark(out)
            else:
                self._unmark(out)
        elif device == HOST:
            self._mark(out)
        else:
            self._unmark(out)

    def _propagate(self, args: tuple, kwargs: dict, out: Any) -> None:
        """An op on host tensors only gives host tensors (CUDA ops keep their inputs' device)."""
        inputs = [t for t in _tensors((*args, *kwargs.values()))]
        if inputs and all(t in self.host for t in inputs):
            self._mark(out)


_tracker: HostTracker | None = None


def _checked(name: str, func: Callable, tracker: HostTracker) -> Callable:
    @functools.wraps(func)
    def collective(*args, **kwargs):
        tracker.check(f"torch.distributed.{name}", (*args, *kwargs.values()))
        return func(*args, **kwargs)

    collective.__meshplan_strict__ = True
    return collective


def _unchecked(func: Callable, tracker: HostTracker) -> Callable:
    @functools.wraps(func)
    def object_collective(*args, **kwargs):
        tracker.exempt += 1
        try:
            return func(*args, **kwargs)
        finally:
            tracker.exempt -= 1

    return object_collective


def install() -> HostTracker:
    """Turn on device-only collectives in this process (idempotent); returns the tracker."""
    global _tracker
    if _tracker is not None:
        return _tracker
    tracker = HostTracker()
    for name in (*_COLLECTIVES, *_OBJECT_COLLECTIVES):
        func = getattr(distributed_c10d, name)
        wrapped = (_checked(name, func, tracker) if name in _COLLECTIVES
                   else _unchecked(func, tracker))
        setattr(distributed_c10d, name, wrapped)
        if getattr(dist, name, None) is func:
            setattr(dist, name, wrapped)
    tracker.__enter__()
    _tracker = tracker
    return tracker


def tracker() -> HostTracker | None:
    """The installed tracker (None when strict mode is off)."""
    return _tracker
