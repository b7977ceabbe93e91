"""The OpenCL backend's convolution: im2col + the one GEMM of gemm.cl, forward and backward.

The columns are written straight into the GEMM's packed B layout (column panels),
so neither a transpose nor a separate packing pass is needed:

    forward  Y         = W @ cols           A = W (F, K)                    B = im2col(x) panels
    dW, db   [dW | db] = dY @ [cols^T | 1]  A = dY in place, as (F, N*OH*OW)  B = im2row(x) panels
    dX       dcols     = W^T @ dY           A = W^T (K, F), transposed once  B = dY panels

with K = C*KH*KW. The GEMM writes y straight into NCHW, adding the bias; why the columns are
rebuilt in backward, the bias gradient is a column of the dW GEMM, and CPUs run other kernels:
docs/gpus.md.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import pyopencl.array as cla

from backends.base import Cache, conv_output_size
from backends.opencl.cl_runtime import ClRuntime
from backends.opencl.gemm import AView, CView
from backends.opencl.gemm_configs import cdiv

i32 = np.int32


def window(kh: int, kw: int, stride: int, padding: int) -> str:
    """The build of layout.cl's kernels with a convolution's window compiled in (col2im, the rows and lanes kernels)."""
    return f"-DKH={kh} -DKW={kw} -DSTRIDE={stride} -DPAD={padding}"


def lanes_fit(kh: int, kw: int, stride: int, ow: int, nb: int, transposed: bool) -> bool:
    """Whether layout.cl's *_panels_lanes kernels (8 pixels of an output row a vector) take this
    shape: stride 1 or 2, output rows and panels whole vectors (OW and NB multiples of 8), NB at
    most 64 for im2row's tap arrays. Not for im2col with a 1x1 window (conv_dx's dy panels): each tap
    is then a plain copy of a plane, which the row walk does faster (measured: the lanes kernel
    1.2-2x slower there; a work-item per panel reads a line of each of the F planes)."""
    if stride not in (1, 2) or ow % 8 or nb % 8:
        return False
    return nb <= 64 if transposed else kh * kw > 1


def col2im_lanes_fit(stride: int, w: int, kdim: int, npix: int) -> bool:
    """Whether layout.cl's col2im_lanes (8 dx elements of an input row a vector) takes this shape:
    stride 1, input rows whole vectors (W a multiple of 8), dcols (kdim, npix) indexed in int32."""
    return stride == 1 and w % 8 == 0 and kdim * npix < 2**31


def im2col_tables(
    rt: ClRuntime, x_shape: tuple[int, ...], kh: int, kw: int, stride: int, padding: int, oh: int, ow: int
) -> tuple[cla.Array, cla.Array]:
    """The pixel and tap tables of layout.cl's im2col: (N*OH*OW, 4) and (C*KH*KW, 4) int32."""
    n, c, h, w = x_shape
    npix, kdim = n * oh * ow, c * kh * kw
    pixel, tap = rt.empty((npix, 4), np.int32), rt.empty((kdim, 4), np.int32)
    geometry = (i32(c), i32(h), i32(w), i32(oh), i32(ow), i32(stride), i32(padding))
    rt.launch("pixel_table", npix, *geometry, i32(npix), pixel.data)
    rt.launch("tap_table", kdim, i32(h), i32(w), i32(kh), i32(kw), i32(kdim), tap.data)
    return pixel, tap


def im2col_panels(
    rt: ClRuntime, x: cla.Array, win: tuple[int, int, int, int], oh: int, ow: int, tables: tuple, nb: int
) -> cla.Array:
    """B(k, p) = x_pad[n, c, oh*s + i, ow*s + j], k = (c, i, j), p = (n, oh, ow): the columns of x
    (N, C, H, W) for ``win`` (KH, KW, stride, padding), in the GEMM's panels of width nb."""
    kh, kw, stride, padding = win
    n, c, h, w = x.shape
    npix, kdim, build = n * oh * ow, c * kh * kw, window(*win)
    out = rt.empty((cdiv(npix, nb) * kdim * nb,))
    geometry, panel = (i32(c), i32(h), i32(w), i32(oh), i32(ow), i32(n)), (i32(nb), out.data)
    if rt.rows and lanes_fit(kh, kw, stride, ow, nb, False):  # optimisation (layout.cl): vectors of pixels
        rt.launch("im2col_panels_lanes", (cdiv(npix, nb),), x.data, *geometry, *panel, defines=build, rows=True)
    elif rt.rows:  # optimisation (layout.cl): a work-item copies a tap over an image
        rt.launch("im2col_panels_rows", (kdim, n), x.data, *geometry, *panel, defines=build, rows=True)
    else:
        pixel, tap = tables
        args = (pixel.data, tap.data, i32(h), i32(w), i32(npix), i32(kdim))
        rt.launch("im2col_panels", (nb, kdim, cdiv(npix, nb)), x.data, *args, *panel)
    return out


def forward(
    rt: ClRuntime, x: cla.Array, w: cla.Array, b: cla.Array, stride: int = 1, padding: int = 0
) -> tuple[cla.Array, Cache]:
    """x (N, C, H, W), w (F, C, KH, KW), b (F,) -> (y (N, F, OH, OW), cache): Y = W @ cols + b."""
    x, w, b = rt.operand(x, "conv2d x"), rt.operand(w, "conv2d w"), rt.operand(b, "conv2d b")
    if stride < 1 or padding < 0:
        raise ValueError(f"conv2d: stride must be >= 1 and padding >= 0, got {stride} and {padding}")
    f, c, kh, kw = w.shape
    if x.ndim != 4 or x.shape[1] != c:
        raise ValueError(f"conv2d: input {x.shape} does not match weights {w.shape} (N, C, H, W)")
    if b.shape != (f,):
        raise ValueError(f"conv2d: bias {b.shape} does not match weights {w.shape}: expected ({f},)")
    n, _, h, wd = x.shape
    oh = conv_output_size(h, kh, stride, padding)
    ow = conv_output_size(wd, kw, stride, padding)
    kdim, npix = c * kh * kw, n * oh * ow
    pixel, tap = im2col_tables(rt, x.shape, kh, kw, stride, padding, oh, ow)
    cols = partial(im2col_panels, rt, x, (kh, kw, stride, padding), oh, ow, (pixel, tap))  # cols(nb): B panels

    # Y (F, N*OH*OW) = W (F, K) @ cols, stored as y[n, f, q]: column p = (n, q)
    y = rt.empty((n, f, oh, ow))
    a, c_view = AView(w.data, kdim, 1, kdim), CView(y.data, oh * ow, 1, oh * ow, f * oh * ow)
    rt.gemm("conv_fwd", f, npix, kdim, a, cols, c_view, bias=b)
    return y, (x, w, stride, padding, pixel, tap)


def backward(
    rt: ClRuntime, dy: cla.Array, cache: Cache, need_dx: bool = True
) -> tuple[cla.Array | None, cla.Array, cla.Array]:
    """dy (N, F, OH, OW) -> (dx or None, dw, db): [dW | db] = dY @ [cols^T | 1], dx by conv_dx."""
    x, w, stride, padding, pixel, tap = cache
    dy = rt.operand(dy, "conv2d dy")
    n, c, h, wd = x.shape
    f, _, kh, kw = w.shape
    oh = conv_output_size(h, kh, stride, padding)
    ow = conv_output_size(wd, kw, stride, padding)
    y_shape = (n, f, oh, ow)
    if dy.shape != y_shape:
        raise ValueError(f"conv2d_backward: dy {dy.shape} does not match the forward output {y_shape}")
    q, kdim, npix = oh * ow, c * kh * kw, n * oh * ow
    geometry, build = (i32(c), i32(h), i32(wd), i32(oh), i32(ow), i32(n)), window(kh, kw, stride, padding)

    def cols_t(nb: int) -> cla.Array:  # B(p, k) = [cols^T | 1]: the columns again, from x
        out = rt.empty((cdiv(kdim + 1, nb) * npix * nb,))
        panel, grid = (i32(nb), out.data), (cdiv(kdim + 1, nb), n)
        if rt.rows and lanes_fit(kh, kw, stride, ow, nb, True):  # optimisation (layout.cl): 8x8 tiles
            rt.launch("im2row_panels_lanes", grid, x.data, *geometry, *panel, defines=build, rows=True)
        elif rt.rows:  # optimisation (layout.cl): a work-item writes a panel's block of an image
            rt.launch("im2row_panels_rows", grid, x.data, *geometry, *panel, defines=build, rows=True)
        else:
            tables = (pixel.data, tap.data, i32(h), i32(wd), i32(npix), i32(kdim))
            rt.launch("im2row_panels", (nb, npix, cdiv(kdim + 1, nb)), x.data, *tables, *panel)
        return out

    # [dW | db] (F, K + 1) = dY (F, N*OH*OW) @ [cols^T | 1], with dY read in place: column
    # p = (n, q) of dY is dy[n, f, q]. The column of ones makes db = sum_{n, q} dy[n, f, q].
    dwb = rt.empty((f * (kdim + 1),))
    rt.gemm("conv_dw", f, kdim + 1, npix, AView(dy.data, q, 1, q, f * q), cols_t, CView.rows(dwb.data, kdim + 1))
    dw, db = rt.empty(w.shape), rt.empty((f,))
    rt.launch("split_last_column", (kdim + 1, f), dwb.data, i32(f), i32(kdim), dw.data, db.data)
    if not need_dx:
        return None, dw, db
    return conv_dx(rt, dy, w, x.shape, stride, padding), dw, db


def conv_dx(
    rt: ClRuntime, dy: cla.Array, w: cla.Array, x_shape: tuple[int, ...], stride: int, padding: int
) -> cla.Array:
    """dx = col2im(W^T dY) for dy (N, F, OH, OW), w (F, C, KH, KW) on the device."""
    n, c, h, wd = x_shape
    f, _, kh, kw = w.shape
    oh, ow = dy.shape[2], dy.shape[3]
    kdim, npix = c * kh * kw, n * oh * ow
    # B(f, p) = dy[n, f, q]: im2col of dy with a 1x1 kernel
    dy_panels = partial(im2col_panels, rt, dy, (1, 1, 1, 0), oh, ow, im2col_tables(rt, dy.shape, 1, 1, 1, 0, oh, ow))

    # dcols (K, N*OH*OW) = W^T (K, F) @ dY, then the col2im gather into dx. W^T is made
    # explicitly (it is small) so A is read along rows: ~2x faster than a strided W^T view.
    w_t = rt.transpose(w, f, kdim)
    dcols = rt.empty((kdim * npix,))
    rt.gemm("conv_dx", kdim, npix, f, AView(w_t.data, f, 1, f), dy_panels, CView.rows(dcols.data, npix))
    dx = rt.empty(x_shape)
    args = (dcols.data, i32(c), i32(h), i32(wd), i32(oh), i32(ow), i32(npix), i32(n * c), dx.data)
    if rt.rows and col2im_lanes_fit(stride, wd, kdim, npix):  # optimisation (layout.cl): 8 elements a vector
        rt.launch("col2im_lanes", (h, n * c), *args, defines=window(kh, kw, stride, padding), rows=True)
    elif rt.rows:  # optimisation (layout.cl): a work-item sums along an input row
        rt.launch("col2im_rows", (h, n * c), *args, defines=window(kh, kw, stride, padding), rows=True)
    else:
        rt.launch("col2im", (wd, h, n * c), *args, defines=window(kh, kw, stride, padding))
    return dx
