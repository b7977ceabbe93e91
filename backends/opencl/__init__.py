"""The OpenCL backend: the numpy reference's ops as OpenCL C 1.2 kernels, for any OpenCL device.

    from backends.opencl import OpenCLBackend, list_devices, select_device, NoOpenCLDevice

``OpenCLBackend(device=None)`` runs on ``select_device(device)``; ``list_devices()``
lists what this machine has (for a CLI's device table). See backend.py for the
ops, conv.py for the convolution, norms.py for the normalisations, maxpool.py for
max pooling, gemm.py for the GEMM and its per-device tuning (gemm_configs.py for its
variants), cl_runtime.py for the device plumbing (programs, launches, buffers),
device.py for device choice.
"""

from backends.opencl.backend import OpenCLBackend
from backends.opencl.device import NoOpenCLDevice, describe_device, device_kind, list_devices, select_device

__all__ = ["OpenCLBackend", "NoOpenCLDevice", "list_devices", "select_device", "describe_device", "device_kind"]
