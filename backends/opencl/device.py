"""Finding and choosing an OpenCL device: ``list_devices()`` and ``select_device(spec)``.

A machine with no OpenCL runtime raises ``NoOpenCLDevice`` saying how to install one, never a bare
pyopencl traceback.
"""

from __future__ import annotations

import os
import re
from typing import Any

import pyopencl as cl

ENV_DEVICE = "TINYCONV_OPENCL_DEVICE"

INSTALL_HINT = (
    "Install an OpenCL runtime: `pip install pocl-binary-distribution` gives a portable CPU "
    "device; for a GPU, install the vendor's driver with its OpenCL ICD (NVIDIA driver, AMD ROCm "
    "or Adrenalin, Intel compute-runtime). Or use the numpy backend (--backend numpy)."
)


class NoOpenCLDevice(RuntimeError):
    """There is no usable OpenCL platform or device on this machine."""


def device_kind(device: cl.Device) -> str:
    """'gpu', 'cpu', 'accelerator' or 'other', from the device type bits."""
    for kind in ("gpu", "cpu", "accelerator"):
        if device.type & getattr(cl.device_type, kind.upper()):
            return kind
    return "other"


def _all_devices() -> list[tuple[int, int, cl.Platform, cl.Device]]:
    """(platform index, device index, platform, device) for every device, in driver order."""
    try:
        platforms = cl.get_platforms()
    except (cl.Error, RuntimeError) as e:  # the ICD loader found no platform (PLATFORM_NOT_FOUND_KHR)
        raise NoOpenCLDevice(f"no OpenCL platform found ({e}). {INSTALL_HINT}") from None
    found = []
    for pi, platform in enumerate(platforms):
        try:
            devices = platform.get_devices()
        except (cl.Error, RuntimeError):  # a platform with no devices (DEVICE_NOT_FOUND) is skipped
            continue
        found += [(pi, di, platform, d) for di, d in enumerate(devices)]
    if not found:
        names = ", ".join(p.name for p in platforms) or "none"
        raise NoOpenCLDevice(f"OpenCL platforms ({names}) have no devices. {INSTALL_HINT}")
    return found


def describe_device(device: cl.Device) -> dict[str, Any]:
    """The facts a worker reports and a benchmark prints about one device."""
    return {
        "name": device.name.strip(),
        "kind": device_kind(device),
        "compute_units": int(device.max_compute_units),
        "platform": device.platform.name.strip(),
        "opencl_version": device.version.strip(),
        "driver": device.driver_version.strip(),
        "global_mem_bytes": int(device.global_mem_size),
        "local_mem_bytes": int(device.local_mem_size),
        "max_work_group_size": int(device.max_work_group_size),
    }


def list_devices() -> list[dict[str, Any]]:
    """Every OpenCL device, as plain dicts (for a CLI table): ``spec`` ("P:D", what select_device takes),
    indices, names, kind, limits."""
    return [
        {"spec": f"{pi}:{di}", "platform_index": pi, "device_index": di, **describe_device(d)}
        for pi, di, _, d in _all_devices()
    ]


def _table(found: list[tuple[int, int, cl.Platform, cl.Device]]) -> str:
    return "; ".join(f"{pi}:{di} {d.name.strip()} ({device_kind(d)}, {p.name.strip()})" for pi, di, p, d in found)


def select_device(spec: str | None = None) -> cl.Device:
    """Choose a device.

    ``spec``: "P:D" (platform and device index, as in list_devices), a kind ("gpu",
    "cpu", "accelerator": the first of that kind), or a case-insensitive substring
    of "<platform name> <device name>" (the first match). None: $TINYCONV_OPENCL_DEVICE
    if set, else the first GPU, else the first device.
    """
    found = _all_devices()
    spec = (spec or os.environ.get(ENV_DEVICE, "")).strip()
    if not spec:
        gpus = [f for f in found if device_kind(f[3]) == "gpu"]
        return (gpus or found)[0][3]
    by_index = {f"{pi}:{di}": d for pi, di, _, d in found}
    if spec in by_index:
        return by_index[spec]
    if re.fullmatch(r"\d+:\d+", spec):
        raise ValueError(f"no OpenCL device {spec!r} (platform:device); devices: {_table(found)}")
    want = spec.lower()
    if want in ("gpu", "cpu", "accelerator"):
        of_kind = [d for _, _, _, d in found if device_kind(d) == want]
        if of_kind:
            return of_kind[0]
    for _, _, p, d in found:
        if want in f"{p.name} {d.name}".lower():
            return d
    raise ValueError(
        f"no OpenCL device matches {spec!r}; give 'P:D', a kind (gpu/cpu/accelerator) or part of a "
        f"name. Devices: {_table(found)}"
    )
