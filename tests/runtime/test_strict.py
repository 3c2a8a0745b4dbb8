"""Device-only collectives on the CPU (runtime/strict.py): which tensors count as host tensors,
and that a collective refuses them. In-process, no process group: the multi-process runtime
tests run every layout with the mode on (conftest.worker_env)."""

from __future__ import annotations

import pytest
import torch

from meshplan.runtime import strict

DEVICE = torch.device("cpu")  # the rank's device, as the runtime holds it


@pytest.fixture
def tracker():
    with strict.HostTracker() as mode:
        yield mode


def test_factories_without_a_device_make_host_tensors(tracker):
    assert tracker.is_host(torch.tensor(1.5, dtype=torch.float64))
    assert tracker.is_host(torch.zeros(3))
    assert tracker.is_host(torch.ones(2, device="cpu"))  # the string names host memory
    assert not tracker.is_host(torch.zeros(3, device=DEVICE))
    assert not tracker.is_host(torch.tensor(1.5, device=DEVICE))


def test_host_placement_propagates_like_cuda(tracker):
    host = torch.tensor(2.0)
    on_device = torch.zeros((), device=DEVICE)
    assert tracker.is_host(host * 3) and tracker.is_host(host.double())
    assert tracker.is_host(torch.stack([host, host]))
    assert not tracker.is_host(on_device + host)  # a host scalar joins a device op
    assert tracker.is_host(on_device.cpu()) and tracker.is_host(on_device.to("cpu"))
    assert not tracker.is_host(on_device)  # moving a copy to the host leaves the original
    assert not tracker.is_host(torch.arange(3).to(DEVICE))
    assert tracker.is_host(torch.ones(2).to(torch.float64))  # a dtype change keeps placement
    on_device.add_(host)  # in place: stays where it is
    assert not tracker.is_host(on_device)


def test_a_collective_refuses_a_host_tensor(tracker):
    calls = []
    all_reduce = strict._checked("all_reduce", lambda t, **kw: calls.append(t), tracker)
    all_reduce(torch.zeros((), device=DEVICE))
    with pytest.raises(strict.HostTensorInCollective, match="all_reduce got a host"):
        all_reduce(torch.tensor(0.25, dtype=torch.float64), op=None)
    all_gather = strict._checked("all_gather", lambda out, t: calls.append(t), tracker)
    with pytest.raises(strict.HostTensorInCollective):
        all_gather([torch.zeros(2, device=DEVICE), torch.ones(2)], torch.zeros(2, device=DEVICE))
    assert len(calls) == 1


def test_the_mode_is_off_unless_asked():
    assert not strict.enabled({})
    assert not strict.enabled({strict.ENV: "0"})
    assert strict.enabled({strict.ENV: "1"})
