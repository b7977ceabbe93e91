"""The OpenCL backend: the numpy reference's ops as OpenCL C 1.2 kernels, for any OpenCL device.

``OpenCLBackend(device=None)`` runs on ``select_device(device)``; ``list_devices()`` lists what this
machine has (for a CLI's device table). docs/layout.md's table of files says which module holds what.
"""

from backends.opencl.backend import OpenCLBackend
from backends.opencl.device import NoOpenCLDevice, describe_device, device_kind, list_devices, select_device

__all__ = ["OpenCLBackend", "NoOpenCLDevice", "list_devices", "select_device", "describe_device", "device_kind"]
