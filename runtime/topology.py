"""How the devices of this machine are linked, as one line for a calibration's provenance.

``nvidia-smi topo -m`` where the binary exists (``parse_topo_matrix``), else pynvml's NVLink
count, else loopback on the CPU. Used by ``meshplan profile`` (``measure.py``).
"""

from __future__ import annotations

import collections
import re
import shutil
import subprocess
from collections.abc import Mapping

import torch

TOPOLOGY_TIMEOUT_S = 20.0
"""Limit on ``nvidia-smi topo -m``."""

TOPO_LINKS = {"NV": "NVLink", "PIX": "PCIe", "PXB": "PCIe", "PHB": "PCIe/host",
              "NODE": "PCIe/host", "SYS": "PCIe/host"}
"""``nvidia-smi topo -m`` connection codes: ``NV#`` a bonded set of # NVLinks; PIX one PCIe
bridge; PXB several; PHB through a PCIe host bridge (the CPU); NODE between host bridges of one
NUMA node; SYS across the CPUs' SMP interconnect."""
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_DEVICE = re.compile(r"(GPU|NIC)\d+")


def parse_topo_matrix(text: str) -> dict[tuple[str, str], str]:
    """GPU-to-GPU connection codes of ``nvidia-smi topo -m`` output: ``{("GPU0", "GPU1"):
    "NV18", ...}`` for every ordered pair of GPUs (``X`` on the diagonal, so one GPU gives
    ``{("GPU0", "GPU0"): "X"}``). ValueError without a GPU matrix.

    The header line starts with whitespace and names the columns (``GPU0 ... NIC0 ...`` then
    affinity columns); each row starts with its device and has one code per column.
    """
    lines = [_ANSI.sub("", line) for line in text.splitlines()]
    header = next((line for line in lines if line[:1].isspace() and "GPU0" in line.split()),
                  None)
    if header is None:
        raise ValueError("no 'GPU0 GPU1 ...' header in the nvidia-smi topo -m output")
    columns = [cell for cell in header.split() if _DEVICE.fullmatch(cell)]
    pairs = {}
    for line in lines:
        cells = line.split()
        if not cells or not re.fullmatch(r"GPU\d+", cells[0]):
            continue
        pairs.update({(cells[0], col): code for col, code in zip(columns, cells[1:])
                      if col.startswith("GPU")})
    if not pairs:
        raise ValueError("no GPU rows in the nvidia-smi topo -m output")
    return pairs


def link_name(code: str) -> str:
    """``NVLink``, ``PCIe`` or ``PCIe/host`` for an ``nvidia-smi topo -m`` code."""
    return TOPO_LINKS.get("NV" if re.fullmatch(r"NV\d+", code) else code, "unknown")


def summarize_topology(pairs: Mapping[tuple[str, str], str]) -> str:
    """One line: GPU count and how many GPU pairs each connection code joins."""
    gpus = sorted({a for a, _ in pairs} | {b for _, b in pairs}, key=lambda g: int(g[3:]))
    counts = collections.Counter(code for (a, b), code in pairs.items()
                                 if int(a[3:]) < int(b[3:]))
    links = ", ".join(f"{n} x {code} ({link_name(code)})" for code, n in counts.most_common())
    if not links:
        return f"{len(gpus)} GPU; no GPU-to-GPU links (nvidia-smi topo -m)"
    return f"{len(gpus)} GPUs; GPU pairs: {links} (nvidia-smi topo -m)"


def detect_topology(*, nodes: int = 1) -> str:
    """One line on how this machine's devices are linked (see the module docstring)."""
    across = f"; {nodes} nodes over the network" if nodes > 1 else ""
    if not torch.cuda.is_available():
        return f"loopback: CPU processes over TCP on this host (no GPU links){across}"
    exe = shutil.which("nvidia-smi")
    if exe:
        try:
            done = subprocess.run([exe, "topo", "-m"], capture_output=True, text=True,
                                  timeout=TOPOLOGY_TIMEOUT_S, check=True)
            return summarize_topology(parse_topo_matrix(done.stdout)) + across
        except (subprocess.SubprocessError, OSError, ValueError) as err:
            return f"unknown: nvidia-smi topo -m failed ({str(err).splitlines()[0]}){across}"
    return _nvml_topology() + across


def _nvml_topology() -> str:
    try:
        import pynvml
    except ImportError:
        return "unknown: neither nvidia-smi nor pynvml is available"
    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        active = 0
        for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
            try:
                state = pynvml.nvmlDeviceGetNvLinkState(handle, link)
            except pynvml.NVMLError:  # no such link on this GPU
                break
            active += state == pynvml.NVML_FEATURE_ENABLED
        return (f"{pynvml.nvmlDeviceGetCount()} GPUs; GPU 0 has {active} active NVLinks "
                "(pynvml)")
    except pynvml.NVMLError as err:
        return f"unknown: pynvml failed ({err})"
