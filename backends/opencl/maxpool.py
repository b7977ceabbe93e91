"""The OpenCL backend's max pooling, forward and backward.

One work-item per output scans its window and keeps the first strict maximum in row-major
order -- the element numpy's separable max selects -- or its last NaN, as torch does, and its
position (on CPUs, one work-item per plane, or several, 8 windows at a time as vectors where
output rows are whole vectors); backward is a gather over the windows that contain each input
(on CPUs, one work-item per plane or several, scattering from the last window to the first, or for
the 3x3 stride-2 pool gathering 8 windows a vector: the same sums in the same order). See ops.cl.
"""

from __future__ import annotations

import numpy as np
import pyopencl.array as cla

from backends.base import Cache, conv_output_size
from backends.opencl.cl_runtime import ClRuntime
from backends.opencl.gemm_configs import cdiv

i32 = np.int32

# An optimisation, the planes kernels' work-items: input elements one walks, in whole planes
# (several small planes per item: PoCL pays per work-item, and conv2's are 256 elements).
POOL_WALK = 4096


def lanes_fit(stride: int, ow: int) -> bool:
    """Whether maxpool_forward_lanes (8 windows a vector) takes it: stride 1 or 2, rows of whole vectors."""
    return stride in (1, 2) and ow % 8 == 0


def plane_defines(window: str, h: int, w: int, group: int) -> str:
    """The planes kernels' build: the window, the (h, w) plane size and planes per work-item (see ops.cl)."""
    return f"{window} -DPLANE_H={h} -DPLANE_W={w} -DPLANE_GROUP={group}"


def _planes(rt: ClRuntime, name: str, shape: tuple[int, ...], window: str, args: tuple) -> None:
    """Launch the planes kernel ``name`` (a work-item walks whole planes of the (N, C, H, W) input, their
    size compiled in) with about POOL_WALK elements an item, and at least 4 items per compute unit while
    there are planes for them."""
    n, c, h, w = shape
    per_unit = max(1, n * c // (4 * rt.limits.compute_units))
    group = max(1, min(POOL_WALK // (h * w), per_unit))
    rt.launch(name, cdiv(n * c, group), *args, defines=plane_defines(window, h, w, group), rows=True)


def forward(rt: ClRuntime, x: cla.Array, kernel: int = 2, stride: int = 2, padding: int = 0) -> tuple[cla.Array, Cache]:
    """x (N, C, H, W) -> (y (N, C, OH, OW), cache), padding counting as -inf."""
    x = rt.operand(x, "maxpool x")
    n, c, h, w = x.shape
    if kernel < 1 or stride < 1 or not 0 <= 2 * padding <= kernel:
        raise ValueError(
            f"maxpool: need kernel and stride >= 1, 0 <= padding <= kernel/2; got {kernel}, {stride}, {padding}"
        )
    oh = conv_output_size(h, kernel, stride, padding)
    ow = conv_output_size(w, kernel, stride, padding)
    y, arg = rt.empty((n, c, oh, ow)), rt.empty((n, c, oh, ow), np.int32)
    geometry = (i32(h), i32(w), i32(oh), i32(ow), i32(n * c))
    window = f"-DPOOL={kernel} -DSTRIDE={stride} -DPAD={padding}"
    args = (x.data, *geometry, y.data, arg.data)
    if rt.rows:  # optimisation (see ops.cl): a work-item walks a plane, 8 windows at a time where they fit
        name = "maxpool_forward_lanes" if lanes_fit(stride, ow) else "maxpool_forward_planes"
        _planes(rt, name, x.shape, window, args)
    elif n * c <= 2:
        rt.launch("maxpool_forward", (ow, oh, n * c), *args, defines=window)
    else:  # optimisation (see ops.cl): the first and last plane simple, the rest branch-free
        knl, _ = rt.kernel("maxpool_forward", window)
        for plane in (0, n * c - 1):  # one plane of the grid, at a global offset
            rt.ran("maxpool_forward", rt.enqueue(knl, (ow, oh, 1), None, *args, global_offset=(0, 0, plane)))
        rt.launch("maxpool_forward_inner", (ow, oh, n * c - 2), *args, defines=window)
    lanes_back = (kernel, stride, padding) == (3, 2, 1) and ow % 8 == 0 and w == 2 * ow  # CPUs' gather (ops.cl)
    return y, (x.shape, arg, geometry, window, lanes_back)


def backward(rt: ClRuntime, dy: cla.Array, cache: Cache) -> cla.Array:
    """dy (N, C, OH, OW) -> dx (N, C, H, W): each dy summed into the input its window's maximum came from."""
    x_shape, arg, geometry, window, lanes_back = cache
    dy = rt.operand(dy, "maxpool dy")
    if dy.shape != arg.shape:
        raise ValueError(f"maxpool_backward: dy {dy.shape} does not match the forward output {arg.shape}")
    dx = rt.empty(x_shape)
    n, c, h, w = x_shape
    args = (dy.data, arg.data, *geometry, dx.data)
    if rt.rows:  # optimisation (see ops.cl): a work-item gathers a plane's dx 8 windows at a time, or scatters its dy
        _planes(rt, "maxpool_backward_lanes" if lanes_back else "maxpool_backward_planes", x_shape, window, args)
    else:
        rt.launch("maxpool_backward", (w, h, n * c), *args, defines=window)
    return dx
