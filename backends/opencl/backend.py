"""The OpenCL backend: the numpy reference's ops, one for one, on arrays that live on the device.

Read it side by side with ``backends/numpy_backend.py``: the methods come in the
same order and do the same arithmetic; where numpy calls a vectorised expression
this calls a kernel of ``ops.cl``, and where numpy calls BLAS this calls the one
GEMM of ``gemm.cl`` (through ``gemm.py``, which picks its variant per device).

Arrays are ``pyopencl.array.Array`` (float32, C-contiguous) allocated from a
memory pool, and stay on the device between ops: the host sees data only in
``asarray``, ``to_numpy`` and the scalar loss. All work goes to one in-order
queue, so ops never wait for each other on the host; ``synchronize()`` does.

Convolution is im2col + GEMM, with the columns written straight into the
GEMM's packed B layout (column panels), so neither a transpose nor a separate
packing pass is needed:

    forward  Y         = W @ cols           A = W (F, K)                    B = im2col(x) panels
    dW, db   [dW | db] = dY @ [cols^T | 1]  A = dY in place, as (F, N*OH*OW)  B = im2row(x) panels
    dX       dcols     = W^T @ dY           A = W^T (K, F), transposed once  B = dY panels

with K = C*KH*KW. The GEMM writes y straight into NCHW, adding the bias; the
column of ones appended to cols^T makes the bias gradient one more output column
of the dW GEMM (free: it lands in the panel padding); col2im is a gather. The
columns are rebuilt from x in backward rather than kept from forward: that costs
one cheap pass over x and saves holding K*N*OH*OW floats per conv layer between
forward and backward. Integer division is slow on CPUs, so the kernels never
split a flat index per element: im2col adds entries of two small tables, and the
kernels whose loops depend on a layer's window are compiled per window (see ops.cl).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pyopencl as cl
import pyopencl.array as cla
import pyopencl.tools as cl_tools

from backends.base import Backend, conv_output_size
from backends.opencl.device import describe_device, device_kind, select_device
from backends.opencl.gemm import ENV_AUTOTUNE, AView, CView, DeviceLimits, Gemm, cdiv, default_tune_file

F32 = np.float32
i32 = np.int32
HERE = Path(__file__).resolve().parent
MAX_ELEMENTS = 2**31 - 1  # kernels index with 32-bit ints


class OpenCLBackend(Backend):
    """One OpenCL device (see ``backends.opencl.device.select_device`` for ``device``).

    ``autotune``: time the GEMM variants on first use of each large shape (default: on,
    unless $TINYCONV_OPENCL_AUTOTUNE=0); ``tune_file``: where the choices are kept.
    """

    name = "opencl"

    def __init__(
        self,
        device: str | None = None,
        autotune: bool | None = None,
        tune_file: str | Path | None = None,
        **_: Any,
    ) -> None:
        self.device = select_device(device)
        self.context = cl.Context([self.device])
        self.queue = cl.CommandQueue(self.context)
        # Allocating a buffer is slow on some drivers; the pool reuses freed ones. Safe
        # with one in-order queue: a reused buffer's next writer queues after its last reader.
        self.pool = cl_tools.MemoryPool(cl_tools.ImmediateAllocator(self.queue))
        limits = DeviceLimits.of(self.device, device_kind(self.device))
        self.limits = limits
        self.wg = min(256, limits.max_work_group_size)  # 1-D launches: many items, any device
        self.rl = 1 << (min(128, limits.max_work_group_size).bit_length() - 1)  # reduce_rows' group
        self._programs: dict[tuple[str, str], cl.Program] = {}
        self._kernels: dict[str, tuple[cl.Kernel, int]] = {}
        if autotune is None:
            autotune = os.environ.get(ENV_AUTOTUNE, "1") != "0"
        self.gemm = Gemm(
            self.program,
            self.queue,
            limits,
            lambda n: self._empty((n,)),
            autotune,
            Path(tune_file) if tune_file is not None else default_tune_file(),
        )

    # ---- programs and launches ---------------------------------------------------
    def program(self, filename: str, options: str = "") -> cl.Program:
        """``filename`` (beside this module) built once per context with ``options``.

        The build itself is cached on disk between runs: by pyopencl's binary cache on most
        platforms, and on PoCL (which pyopencl leaves to it) by PoCL's own kernel cache.
        """
        key = (filename, options)
        if key not in self._programs:
            source = (HERE / filename).read_text()
            try:
                self._programs[key] = cl.Program(self.context, source).build(
                    options=["-cl-std=CL1.2", *options.split()]
                )
            except cl.RuntimeError as e:
                raise RuntimeError(
                    f"OpenCL could not compile {filename} ({options or 'no options'}) for "
                    f"{self.device.name.strip()}: {e}"
                ) from None
        return self._programs[key]

    def _kernel(self, name: str, defines: str = "") -> tuple[cl.Kernel, int]:
        """The ops.cl kernel ``name`` (built with ``defines``) and the work-group size to launch it with."""
        key = f"{name} {defines}"
        if key not in self._kernels:
            knl = cl.Kernel(self.program("ops.cl", f"-DRL={self.rl} {defines}".strip()), name)
            limit = int(knl.get_work_group_info(cl.kernel_work_group_info.WORK_GROUP_SIZE, self.device))
            if name == "reduce_rows" and limit < self.rl:  # its group size is compiled in: rebuild smaller
                self.rl = 1 << (limit.bit_length() - 1)
                return self._kernel(name, defines)
            self._kernels[key] = (knl, min(self.wg, limit))
        return self._kernels[key]

    def _launch(self, name: str, dims: int | tuple[int, ...], *args: Any, defines: str = "") -> None:
        """Run the ops.cl kernel ``name`` over a 1-3 dimensional grid of ``dims`` work-items.

        Work-groups fill up to self.wg items, innermost dimension first; the grid is rounded
        up to whole groups and every kernel checks its bounds. ``defines`` selects a build of
        ops.cl with a layer's window compiled in (see the header of ops.cl).
        """
        knl, wg = self._kernel(name, defines)
        dims = (dims,) if isinstance(dims, int) else dims
        if min(dims) <= 0:
            return
        local: list[int] = []
        for d in dims:
            room = wg // int(np.prod(local or [1]))
            local.append(min(1 << (d - 1).bit_length(), room))
        grid = tuple(cdiv(d, lo) * lo for d, lo in zip(dims, local, strict=True))
        knl(self.queue, grid, tuple(local), *args)

    def _empty(self, shape: tuple[int, ...], dtype: type = F32) -> cla.Array:
        size = int(np.prod(shape))
        if size > MAX_ELEMENTS:
            raise ValueError(
                f"an array of {size} elements {shape} is past the kernels' 32-bit indexing; "
                f"use a smaller batch"
            )
        return cla.empty(self.queue, shape, dtype, allocator=self.pool)

    def _dev(self, a: Any, what: str, in_place: bool = False) -> cla.Array:
        """Check that ``a`` is a float32 array of this backend; views are made contiguous."""
        if not isinstance(a, cla.Array):
            raise TypeError(
                f"{what}: expected an array of this OpenCL backend, got {type(a).__name__}; "
                f"convert host arrays with backend.asarray()"
            )
        if a.context != self.context:
            raise ValueError(
                f"{what}: the array belongs to another OpenCL context (another backend instance); "
                f"move it with backend.asarray(other_backend.to_numpy(a))"
            )
        if a.dtype != F32:
            raise TypeError(f"{what}: expected float32, got {a.dtype}")
        if a.offset == 0 and a.flags.c_contiguous:
            return a
        if in_place:
            raise ValueError(f"{what} is updated in place, so it must be a whole array, not a view or slice")
        if not a.flags.c_contiguous:
            raise ValueError(f"{what}: a non-contiguous view; pass a contiguous array")
        return a.copy()  # a slice at an offset (e.g. rows of a weight): kernels take whole buffers

    def _reduce_rows(
        self,
        src: cla.Array,
        rows: int,
        na: int,
        nb: int,
        strides: tuple[int, int, int],
        mode: int = 0,
        src2: cla.Array | None = None,
        center: cla.Array | None = None,
        divisor: float = 1.0,
    ) -> cla.Array:
        """out[m] = sum_{a<na, b<nb} f(src[m*s0 + a*s1 + b*s2]) / divisor (f: see reduce_rows in ops.cl)."""
        out = self._empty((rows,))
        if rows == 0:
            return out
        knl, _ = self._kernel("reduce_rows")
        s0, s1, s2 = strides
        knl(self.queue, (rows * self.rl,), (self.rl,), src.data, None if src2 is None else src2.data,
            None if center is None else center.data, i32(mode), i32(na), i32(nb), i32(s0), i32(s1), i32(s2),
            F32(divisor), out.data)
        return out

    def _pack(self, src: cla.Array, k: int, n: int, sk: int, sn: int, nb: int) -> cla.Array:
        """B(k, n) = src[k*sk + n*sn] in the GEMM's panel layout of width nb."""
        out = self._empty((cdiv(n, nb) * k * nb,))
        self._launch("pack_panels", (nb, k, cdiv(n, nb)), src.data, i32(k), i32(n), i32(sk), i32(sn), i32(nb),
                     out.data)
        return out

    def _transpose(self, src: cla.Array, rows: int, cols: int) -> cla.Array:
        """A (rows, cols) row-major matrix -> its (cols, rows) transpose."""
        out = self._empty((cols * rows,))
        self._launch("transpose", (cols, rows), src.data, i32(rows), i32(cols), out.data)
        return out

    def _im2col_tables(self, x_shape, kh, kw, stride, padding, oh, ow) -> tuple[cla.Array, cla.Array]:
        """The pixel and tap tables of ops.cl's im2col: (N*OH*OW, 4) and (C*KH*KW, 4) int32."""
        n, c, h, w = x_shape
        npix, kdim = n * oh * ow, c * kh * kw
        pixel, tap = self._empty((npix, 4), np.int32), self._empty((kdim, 4), np.int32)
        self._launch("pixel_table", npix, i32(c), i32(h), i32(w), i32(oh), i32(ow), i32(stride), i32(padding),
                     i32(npix), pixel.data)
        self._launch("tap_table", kdim, i32(h), i32(w), i32(kh), i32(kw), i32(kdim), tap.data)
        return pixel, tap

    # ---- edges ---------------------------------------------------------------------
    def asarray(self, x: np.ndarray) -> cla.Array:
        if isinstance(x, cla.Array):  # already on a device: copy it here
            x = x.copy() if x.context == self.context else x.get()
            if isinstance(x, cla.Array):
                return x
        a = np.asarray(x)
        if a.dtype.kind == "f":
            a = np.ascontiguousarray(a, dtype=F32)
        elif a.dtype.kind in "iub":
            a = np.ascontiguousarray(a)
        else:
            raise TypeError(f"asarray: cannot put a {a.dtype} array on an OpenCL device; use float32 or ints")
        return cla.to_device(self.queue, a, allocator=self.pool)

    def to_numpy(self, x: cla.Array) -> np.ndarray:
        if isinstance(x, cla.Array):
            return x.get()
        return np.asarray(x)

    def zeros(self, shape: tuple[int, ...]) -> cla.Array:
        return cla.zeros(self.queue, tuple(shape), F32, allocator=self.pool)

    def describe(self) -> dict[str, Any]:
        d = describe_device(self.device)
        return {
            "backend": self.name,
            "device": d.pop("name"),
            "kind": d.pop("kind"),
            "compute_units": d.pop("compute_units"),
            **d,
        }

    def synchronize(self) -> None:
        self.queue.finish()

    # ---- convolution ---------------------------------------------------------------
    def conv2d_forward(self, x, w, b, stride=1, padding=0):
        x, w, b = self._dev(x, "conv2d x"), self._dev(w, "conv2d w"), self._dev(b, "conv2d b")
        if w.ndim != 4:
            raise ValueError(f"conv2d: weights must be (F, C, KH, KW), got {w.shape}")
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
        pixel, tap = self._im2col_tables(x.shape, kh, kw, stride, padding, oh, ow)

        def cols(nb: int) -> cla.Array:  # B(k, p) = x_pad[n, c, oh*s + i, ow*s + j], k = (c, i, j)
            out = self._empty((cdiv(npix, nb) * kdim * nb,))
            self._launch("im2col_panels", (nb, kdim, cdiv(npix, nb)), x.data, pixel.data, tap.data, i32(h),
                         i32(wd), i32(npix), i32(kdim), i32(nb), out.data)
            return out

        # Y (F, N*OH*OW) = W (F, K) @ cols, stored as y[n, f, q]: column p = (n, q)
        y = self._empty((n, f, oh, ow))
        self.gemm("conv_fwd", f, npix, kdim, AView(w.data, kdim, 1, kdim), cols,
                  CView(y.data, oh * ow, 1, oh * ow, f * oh * ow), bias=b)
        return y, (x, w, stride, padding, pixel, tap)

    def conv2d_backward(self, dy, cache, need_dx=True):
        x, w, stride, padding, pixel, tap = cache
        dy = self._dev(dy, "conv2d dy")
        n, c, h, wd = x.shape
        f, _, kh, kw = w.shape
        oh = conv_output_size(h, kh, stride, padding)
        ow = conv_output_size(wd, kw, stride, padding)
        y_shape = (n, f, oh, ow)
        if dy.shape != y_shape:
            raise ValueError(f"conv2d_backward: dy {dy.shape} does not match the forward output {y_shape}")
        q, kdim, npix = oh * ow, c * kh * kw, n * oh * ow

        def cols_t(nb: int) -> cla.Array:  # B(p, k) = [cols^T | 1]: the columns again, from x
            out = self._empty((cdiv(kdim + 1, nb) * npix * nb,))
            self._launch("im2row_panels", (nb, npix, cdiv(kdim + 1, nb)), x.data, pixel.data, tap.data,
                         i32(h), i32(wd), i32(npix), i32(kdim), i32(nb), out.data)
            return out

        # [dW | db] (F, K + 1) = dY (F, N*OH*OW) @ [cols^T | 1], with dY read in place: column
        # p = (n, q) of dY is dy[n, f, q]. The column of ones makes db = sum_{n, q} dy[n, f, q].
        dwb = self._empty((f * (kdim + 1),))
        self.gemm("conv_dw", f, kdim + 1, npix, AView(dy.data, q, 1, q, f * q), cols_t,
                  CView.rows(dwb.data, kdim + 1))
        dw, db = self._empty(w.shape), self._empty((f,))
        self._launch("split_last_column", (kdim + 1, f), dwb.data, i32(f), i32(kdim), dw.data, db.data)
        if not need_dx:
            return None, dw, db
        return self._conv_dx(dy, w, x.shape, stride, padding), dw, db

    def _conv_dx(self, dy, w, x_shape, stride, padding):
        """dx = col2im(W^T dY) for dy (N, F, OH, OW), w (F, C, KH, KW) on the device."""
        n, c, h, wd = x_shape
        f, _, kh, kw = w.shape
        oh, ow = dy.shape[2], dy.shape[3]
        kdim, npix = c * kh * kw, n * oh * ow
        dy_pixel, dy_tap = self._im2col_tables(dy.shape, 1, 1, 1, 0, oh, ow)

        def dy_panels(nb: int) -> cla.Array:  # B(f, p) = dy[n, f, q]: im2col of dy with a 1x1 kernel
            out = self._empty((cdiv(npix, nb) * f * nb,))
            self._launch("im2col_panels", (nb, f, cdiv(npix, nb)), dy.data, dy_pixel.data, dy_tap.data,
                         i32(oh), i32(ow), i32(npix), i32(f), i32(nb), out.data)
            return out

        # dcols (K, N*OH*OW) = W^T (K, F) @ dY, then the col2im gather into dx. W^T is made
        # explicitly (it is small) so A is read along rows: ~2x faster than a strided W^T view.
        w_t = self._transpose(w, f, kdim)
        dcols = self._empty((kdim * npix,))
        self.gemm("conv_dx", kdim, npix, f, AView(w_t.data, f, 1, f), dy_panels, CView.rows(dcols.data, npix))
        dx = self._empty(x_shape)
        window = f"-DKH={kh} -DKW={kw} -DSTRIDE={stride} -DPAD={padding}"
        self._launch("col2im", (wd, h, n * c), dcols.data, i32(c), i32(h), i32(wd), i32(oh), i32(ow),
                     i32(npix), i32(n * c), dx.data, defines=window)
        return dx

    # ---- elementwise and normalisation ----------------------------------------------
    def relu_forward(self, x):
        x = self._dev(x, "relu x")
        y = self._empty(x.shape)
        self._launch("relu_forward", x.size, x.data, i32(x.size), y.data)
        return y, y

    def relu_backward(self, dy, cache):
        dy = self._dev(dy, "relu dy")
        dx = self._empty(dy.shape)
        self._launch("relu_backward", dy.size, dy.data, cache.data, i32(dy.size), dx.data)
        return dx

    def lrn_forward(self, x, size=5, alpha=1e-4, beta=0.75, k=2.0):
        x = self._dev(x, "lrn x")
        if x.ndim != 4 or size < 1:
            raise ValueError(f"lrn: expected an (N, C, H, W) input and size >= 1, got {x.shape} and {size}")
        before, after = size // 2, (size - 1) // 2
        n, c, hw = x.shape[0], x.shape[1], x.shape[2] * x.shape[3]
        y, s, p = self._empty(x.shape), self._empty(x.shape), self._empty(x.shape)
        self._launch("lrn_forward", (hw, c, n), x.data, i32(c), i32(hw), i32(n), F32(alpha / size), F32(k),
                     F32(beta), y.data, s.data, p.data, defines=f"-DLRN_BEFORE={before} -DLRN_AFTER={after}")
        return y, (x, y, s, p, size, alpha, beta, before, after)

    def lrn_backward(self, dy, cache):
        x, y, s, p, size, alpha, beta, before, after = cache
        dy = self._dev(dy, "lrn dy")
        if dy.shape != x.shape:
            raise ValueError(f"lrn_backward: dy {dy.shape} does not match the forward input {x.shape}")
        n, c, hw = x.shape[0], x.shape[1], x.shape[2] * x.shape[3]
        dx = self._empty(x.shape)
        self._launch("lrn_backward", (hw, c, n), dy.data, x.data, y.data, s.data, p.data, i32(c), i32(hw),
                     i32(n), F32(2.0 * alpha * beta / size), dx.data,
                     defines=f"-DLRN_BEFORE={before} -DLRN_AFTER={after}")
        return dx

    def batchnorm_forward(
        self, x, gamma, beta, running_mean, running_var, training, momentum=0.1, eps=1e-5
    ):
        x = self._dev(x, "batchnorm x")
        if x.ndim != 4:
            raise ValueError(f"batchnorm: expected an (N, C, H, W) input, got {x.shape}")
        gamma, beta = self._dev(gamma, "batchnorm gamma"), self._dev(beta, "batchnorm beta")
        running_mean = self._dev(running_mean, "batchnorm running_mean", in_place=True)
        running_var = self._dev(running_var, "batchnorm running_var", in_place=True)
        n, c, h, w = x.shape
        if any(a.shape != (c,) for a in (gamma, beta, running_mean, running_var)):
            raise ValueError(
                f"batchnorm: gamma, beta and the running statistics must be ({c},) for an input {x.shape}"
            )
        hw, m = h * w, n * h * w
        if training:
            mean = self._reduce_rows(x, c, n, hw, (hw, c * hw, 1), divisor=m)
            var = self._reduce_rows(x, c, n, hw, (hw, c * hw, 1), mode=2, center=mean, divisor=m)
            unbiased = momentum * m / max(m - 1, 1)  # the running variance is the unbiased one
            self._launch("bn_update_running", c, running_mean.data, running_var.data, mean.data, var.data,
                         i32(c), F32(1 - momentum), F32(momentum), F32(unbiased))
        else:
            mean, var = running_mean, running_var
        invstd = self._empty((c,))
        self._launch("bn_invstd", c, var.data, F32(eps), i32(c), invstd.data)
        xhat, y = self._empty(x.shape), self._empty(x.shape)
        self._launch("bn_forward", (hw, c, n), x.data, mean.data, invstd.data, gamma.data, beta.data, i32(c),
                     i32(hw), i32(n), xhat.data, y.data)
        return y, (xhat, gamma, invstd, training)

    def batchnorm_backward(self, dy, cache):
        xhat, gamma, invstd, training = cache
        dy = self._dev(dy, "batchnorm dy")
        n, c, h, w = dy.shape
        hw = h * w
        dbeta = self._reduce_rows(dy, c, n, hw, (hw, c * hw, 1))
        dgamma = self._reduce_rows(dy, c, n, hw, (hw, c * hw, 1), mode=1, src2=xhat)
        dx = self._empty(dy.shape)
        self._launch("bn_backward", (hw, c, n), dy.data, xhat.data, gamma.data, invstd.data, dgamma.data,
                     dbeta.data, i32(training), F32(n * hw), i32(c), i32(hw), i32(n), dx.data)
        return dx, dgamma, dbeta

    # ---- pooling -----------------------------------------------------------------------
    # One work-item per output scans its window and keeps the first strict maximum in
    # row-major order -- the element numpy's separable max selects -- and its position;
    # backward is a gather over the windows that contain each input.
    def maxpool_forward(self, x, kernel=2, stride=2, padding=0):
        x = self._dev(x, "maxpool x")
        if x.ndim != 4:
            raise ValueError(f"maxpool: expected an (N, C, H, W) input, got {x.shape}")
        n, c, h, w = x.shape
        if kernel < 1 or stride < 1 or not 0 <= 2 * padding <= kernel:
            raise ValueError(
                f"maxpool: need kernel >= 1, stride >= 1 and 0 <= padding <= kernel/2, "
                f"got kernel {kernel}, stride {stride}, padding {padding}"
            )
        oh = conv_output_size(h, kernel, stride, padding)
        ow = conv_output_size(w, kernel, stride, padding)
        y, arg = self._empty((n, c, oh, ow)), self._empty((n, c, oh, ow), np.int32)
        geometry = (i32(h), i32(w), i32(oh), i32(ow), i32(n * c))
        window = f"-DPOOL={kernel} -DSTRIDE={stride} -DPAD={padding}"
        self._launch("maxpool_forward", (ow, oh, n * c), x.data, *geometry, y.data, arg.data, defines=window)
        return y, (x.shape, arg, geometry, window)

    def maxpool_backward(self, dy, cache):
        x_shape, arg, geometry, window = cache
        dy = self._dev(dy, "maxpool dy")
        if dy.shape != arg.shape:
            raise ValueError(f"maxpool_backward: dy {dy.shape} does not match the forward output {arg.shape}")
        dx = self._empty(x_shape)
        n, c, h, w = x_shape
        self._launch("maxpool_backward", (w, h, n * c), dy.data, arg.data, *geometry, dx.data, defines=window)
        return dx

    # ---- dense ---------------------------------------------------------------------------
    def linear_forward(self, x, w, b):
        x, w, b = self._dev(x, "linear x"), self._dev(w, "linear w"), self._dev(b, "linear b")
        n, d = x.shape[0], int(np.prod(x.shape[1:]))
        if w.ndim != 2 or w.shape[1] != d:
            raise ValueError(f"linear: input {x.shape} flattens to {d}, weights expect {w.shape[1:]}")
        mo = w.shape[0]
        if b.shape != (mo,):
            raise ValueError(f"linear: bias {b.shape} does not match weights {w.shape}: expected ({mo},)")
        y = self._empty((n, mo))
        # y^T (M, N) = w (M, D) @ x^T (D, N), so the bias is per row; C(m, s) -> y[s, m]
        self.gemm("linear_fwd", mo, n, d, AView(w.data, d, 1, d), lambda nb: self._pack(x, d, n, 1, d, nb),
                  CView(y.data, 1, mo, n), bias=b)
        return y, (x, w)

    def linear_backward(self, dy, cache):
        x, w = cache
        dy = self._dev(dy, "linear dy")
        n, (mo, d) = x.shape[0], w.shape
        if dy.shape != (n, mo):
            raise ValueError(f"linear_backward: dy {dy.shape} does not match the forward output {(n, mo)}")
        dx, dw = self._empty(x.shape), self._empty((mo, d))
        # dx (N, D) = dy (N, M) @ w (M, D)
        self.gemm("linear_dx", n, d, mo, AView(dy.data, mo, 1, mo), lambda nb: self._pack(w, mo, d, d, 1, nb),
                  CView.rows(dx.data, d))
        # dw (M, D) = dy^T (M, N) @ x (N, D)
        self.gemm("linear_dw", mo, d, n, AView(dy.data, 1, mo, n), lambda nb: self._pack(x, n, d, d, 1, nb),
                  CView.rows(dw.data, d))
        db = self._reduce_rows(dy, mo, n, 1, (1, mo, 0))
        return dx, dw, db

    def softmax_cross_entropy(self, logits, labels):
        logits = self._dev(logits, "softmax_cross_entropy logits")
        if isinstance(labels, cla.Array):
            labels = labels.get()
        labels = np.asarray(labels)
        if logits.ndim != 2:
            raise ValueError(f"softmax_cross_entropy: logits must be (N, K), got {logits.shape}")
        n, k = logits.shape
        if (
            labels.shape != (n,)
            or (labels.size and labels.dtype.kind not in "iu")
            or labels.min(initial=0) < 0
            or labels.max(initial=0) >= k
        ):
            raise ValueError(
                f"labels must be {n} ints in [0, {k}), got shape {labels.shape} ({labels.dtype})"
            )
        dev_labels = cla.to_device(self.queue, labels.astype(np.int32), allocator=self.pool)
        d, rows, loss = self._empty((n, k)), self._empty((n,)), self._empty((1,))
        self._launch("softmax_xent", n, logits.data, dev_labels.data, i32(n), i32(k), d.data, rows.data)
        self._launch("mean_of", 1, rows.data, i32(n), loss.data)
        return float(loss.get()[0]), d

    # ---- optimiser -----------------------------------------------------------------------
    def sgd_update(self, param, grad, velocity, lr, momentum, weight_decay):
        param = self._dev(param, "sgd_update param", in_place=True)
        velocity = self._dev(velocity, "sgd_update velocity", in_place=True)
        grad = self._dev(grad, "sgd_update grad")
        if not param.shape == grad.shape == velocity.shape:
            raise ValueError(
                f"sgd_update: param {param.shape}, grad {grad.shape} and velocity {velocity.shape} differ"
            )
        self._launch("sgd_update", param.size, param.data, grad.data, velocity.data, F32(lr), F32(momentum),
                     F32(weight_decay), i32(param.size))

    # ---- small helpers used by the sharded convolution --------------------------------------
    def take_kernels(self, w, start, stop):
        """Rows [start, stop) of w, as a new contiguous array (kernels take whole buffers)."""
        w = self._dev(w, "take_kernels w")
        if not 0 <= start < stop <= w.shape[0]:
            raise ValueError(
                f"take_kernels: rows [{start}, {stop}) are not a non-empty range of {w.shape[0]}"
            )
        return w[start:stop].copy()
