"""The OpenCL backend: the numpy reference's ops, one for one, on arrays that live on the device.

Read it side by side with ``backends/numpy_backend.py``: the methods come in the
same order and do the same arithmetic; where numpy calls a vectorised expression
this calls a kernel of ``ops.cl``, and where numpy calls BLAS this calls the one
GEMM of ``gemm.cl`` (through ``gemm.py``, which picks its variant per device).
The convolution, im2col + that GEMM, is in ``conv.py``; the device plumbing
(programs, kernel launches, buffers) in ``runtime.py``, as ``self.rt``.

Arrays are ``pyopencl.array.Array`` (float32, C-contiguous) allocated from a
memory pool, and stay on the device between ops: the host sees data only in
``asarray``, ``to_numpy`` and the scalar loss. All work goes to one in-order
queue, so ops never wait for each other on the host; ``synchronize()`` does.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pyopencl.array as cla

from backends.base import Backend, WireConversion, conv_output_size, require_batch_statistics
from backends.opencl import conv
from backends.opencl.device import describe_device, select_device
from backends.opencl.gemm import ENV_AUTOTUNE, AView, CView
from backends.opencl.gemm_configs import cdiv
from backends.opencl.runtime import Runtime
from backends.opencl.tune_file import default_tune_file

F32 = np.float32
i32 = np.int32


def plane_defines(window: str, h: int, w: int, group: int) -> str:
    """Max pool's planes kernels' build: the window, the (h, w) plane size and planes per work-item (see ops.cl)."""
    return f"{window} -DPLANE_H={h} -DPLANE_W={w} -DPLANE_GROUP={group}"


def lrn_defines(before: int, after: int, beta: float) -> str:
    """The LRN kernels' build: the window, and whether s^-beta is done by square roots (see ops.cl)."""
    return f"-DLRN_BEFORE={before} -DLRN_AFTER={after} -DLRN_BETA_075={int(beta == 0.75)}"


class OpenCLBackend(Backend, WireConversion):
    """One OpenCL device (see ``backends.opencl.device.select_device`` for ``device``).

    ``autotune``: time the GEMM variants on first use of each large shape (default: on,
    unless $TINYCONV_OPENCL_AUTOTUNE=0); ``tune_file``: where the choices are kept;
    ``profile``: keep every kernel's device time for ``self.rt.kernel_times()`` (benchmarks).

    ``rows``: run the rows kernels of ops.cl (one work-item walks a chunk, plane or row: PoCL
    turns the walk into vector code) instead of the per-element ones (many small work-items, as
    GPUs want). True on CPU devices; tests and benchmarks set it to run either variant.

    ``wire_on_device``: narrow and widen bf16 wire words on the device (``narrow_wire``,
    ``widen_wire``) rather than leave them to the host: on, measured cheaper (see __init__).
    """

    name = "opencl"

    def __init__(
        self,
        device: str | None = None,
        autotune: bool | None = None,
        tune_file: str | Path | None = None,
        profile: bool = False,
        **_: Any,
    ) -> None:
        if autotune is None:
            autotune = os.environ.get(ENV_AUTOTUNE, "1") != "0"
        tune_path = Path(tune_file) if tune_file is not None else default_tune_file()
        self.rt = Runtime(select_device(device), autotune, tune_path, profile)
        # narrow_wire / widen_wire convert bf16 wire words here, on every device: where the reads and
        # writes cross a bus, half the bytes cross it; and on PoCL's CPU device, whose buffers are host
        # memory, one kernel pass still beats numpy's dozen (benchmarks/bench_wire_convert.py: conv2's
        # 64x500x16x16 output narrowed in 3.3 ms instead of 100, widened in 3.4 instead of 6.9)
        self.wire_on_device = True

    @property
    def rows(self) -> bool:
        """Whether the rows kernels run (see Runtime.rows): True on CPU devices."""
        return self.rt.rows

    @rows.setter
    def rows(self, value: bool) -> None:
        self.rt.rows = bool(value)

    # An optimisation, the rows kernels (see ops.cl): elements per work-item of the flat ones.
    CHUNK = 2048


    def _flat(self, name: str, total: int, *args: Any) -> None:
        """Launch the elementwise kernel ``name`` over ``total`` elements: per element, or its rows
        twin, whose arguments are the same and then the chunk."""
        if self.rows:
            items = -(-total // self.CHUNK)
            self.rt.launch(f"{name}_rows", items, *args, i32(self.CHUNK), rows=True)
        else:
            self.rt.launch(name, total, *args)

    def _planes(self, name: str, n: int, c: int, hw: int, *args: Any, defines: str = "") -> None:
        """Launch the per-pixel kernel ``name`` of an (n, c, h*w) map: global (hw, c, n), or its
        rows twin, one work-item per plane: global (c, n). The same arguments."""
        if self.rows:
            self.rt.launch(f"{name}_rows", (c, n), *args, defines=defines, rows=True)
        else:
            self.rt.launch(name, (hw, c, n), *args, defines=defines)

    # An optimisation, LRN's backward on CPUs (see ops.cl): pixels per work-item walking the
    # channels, at most (a whole plane of conv1 or conv2: measured fastest, 256-1024 beside 32-128).
    LRN_BLOCK = 1024

    def _channel_walk(self, name: str, n: int, c: int, hw: int, *args: Any, defines: str = "") -> None:
        """Launch the LRN backward kernel ``name``: per pixel, global (hw, c, n), or on CPUs its
        walk twin, one work-item per block of up to LRN_BLOCK pixels of an image walking the
        channels: global (blocks, n). The same arguments."""
        if self.rows:
            block = min(hw, self.LRN_BLOCK)  # the ring's width, compiled in
            self.rt.launch(f"{name}_walk", (cdiv(hw, block), n), *args, defines=f"{defines} -DLRN_BLOCK={block}",
                           rows=True)
        else:
            self.rt.launch(name, (hw, c, n), *args, defines=defines)

    def _channel_sums(self, src, n, c, hw, mode=0, src2=None, center=None, divisor=1.0):
        """out[c] = sum over (n, q) of f(src[n, c, q]) / divisor (f by mode: see reduce_rows in ops.cl).

        On CPUs (an optimisation): each plane summed by one work-item (reduce_planes), then the
        n partials of each channel; otherwise one work-group per channel (reduce_rows)."""
        if not self.rows:
            return self.rt.reduce_rows(src, c, n, hw, (hw, c * hw, 1), mode=mode, src2=src2, center=center,
                                       divisor=divisor)
        partial = self.rt.empty((n * c,))
        self.rt.launch("reduce_planes", (c, n), src.data, None if src2 is None else src2.data,
                       None if center is None else center.data, i32(mode), i32(c), i32(hw), i32(n), partial.data,
                       rows=True)
        return self.rt.reduce_rows(partial, c, n, 1, (1, c, 0), divisor=divisor)

    # ---- edges ---------------------------------------------------------------------
    def asarray(self, x: np.ndarray) -> cla.Array:
        if isinstance(x, cla.Array):  # already on a device: copy it here
            x = x.copy() if x.context == self.rt.context else x.get()
            if isinstance(x, cla.Array):
                return x
        a = np.asarray(x)
        if a.dtype.kind == "f":
            a = np.ascontiguousarray(a, dtype=F32)
        elif a.dtype.kind in "iub":
            a = np.ascontiguousarray(a)
        else:
            raise TypeError(f"asarray: cannot put a {a.dtype} array on an OpenCL device; use float32 or ints")
        return cla.to_device(self.rt.queue, a, allocator=self.rt.pool)

    def to_numpy(self, x: cla.Array) -> np.ndarray:
        if isinstance(x, cla.Array):
            return x.get()
        return np.asarray(x)

    def zeros(self, shape: tuple[int, ...]) -> cla.Array:
        return cla.zeros(self.rt.queue, tuple(shape), F32, allocator=self.rt.pool)

    def describe(self) -> dict[str, Any]:
        d = describe_device(self.rt.device)
        return {
            "backend": self.name,
            "device": d.pop("name"),
            "kind": d.pop("kind"),
            "compute_units": d.pop("compute_units"),
            **d,
        }

    def synchronize(self) -> None:
        self.rt.queue.finish()

    # ---- wire words on the device (base.py's optional WireConversion, beside the host path; wire.cl) ---
    # bfloat16 only: 2 bytes a number instead of 4 across the device's link, bit for bit the host's
    # words. (fp16 and adt24 stay on the host: fp16's rounding of subnormals and adt24's 3-byte
    # words are not worth a kernel; s8 needs a reduction per plane first.)
    WIRE_FORMATS = frozenset({"bf16"})

    def narrow_wire(self, x, fmt):
        if fmt not in self.WIRE_FORMATS or not self.wire_on_device:
            return None
        x = self.rt.operand(x, "narrow_wire x")
        if x.size == 0:
            return None
        out = self.rt.empty(x.shape, np.uint16)
        overflow = cla.zeros(self.rt.queue, (1,), i32, allocator=self.rt.pool)
        self._flat("narrow_bf16", x.size, x.data, i32(x.size), out.data, overflow.data)
        return out.get(), bool(overflow.get()[0])

    def widen_wire(self, carried, fmt):
        if fmt not in self.WIRE_FORMATS or not self.wire_on_device:
            return None
        c = np.ascontiguousarray(carried)
        if c.dtype != np.dtype("<u2"):
            raise TypeError(f"widen_wire: bf16 words travel as uint16, got {c.dtype}")
        if c.size == 0:
            return None
        words = cla.to_device(self.rt.queue, c, allocator=self.rt.pool)
        y = self.rt.empty(c.shape)
        self._flat("widen_bf16", c.size, words.data, i32(c.size), y.data)
        return y

    # ---- convolution (im2col + GEMM, see conv.py) ------------------------------------
    def conv2d_forward(self, x, w, b, stride=1, padding=0):
        return conv.forward(self.rt, x, w, b, stride, padding)

    def conv2d_backward(self, dy, cache, need_dx=True):
        return conv.backward(self.rt, dy, cache, need_dx)

    # ---- elementwise and normalisation ----------------------------------------------
    def relu_forward(self, x):
        x = self.rt.operand(x, "relu x")
        y = self.rt.empty(x.shape)
        self._flat("relu_forward", x.size, x.data, i32(x.size), y.data)
        return y, y

    def relu_backward(self, dy, cache):
        dy = self.rt.operand(dy, "relu dy")
        dx = self.rt.empty(dy.shape)
        self._flat("relu_backward", dy.size, dy.data, cache.data, i32(dy.size), dx.data)
        return dx

    def lrn_forward(self, x, size=5, alpha=1e-4, beta=0.75, k=1.0):
        x = self.rt.operand(x, "lrn x")
        if x.ndim != 4 or size < 1:
            raise ValueError(f"lrn: expected an (N, C, H, W) input and size >= 1, got {x.shape} and {size}")
        before, after = size // 2, (size - 1) // 2
        n, c, hw = x.shape[0], x.shape[1], x.shape[2] * x.shape[3]
        y, s, p = self.rt.empty(x.shape), self.rt.empty(x.shape), self.rt.empty(x.shape)
        self._planes("lrn_forward", n, c, hw, x.data, i32(c), i32(hw), i32(n), F32(alpha / size), F32(k),
                       F32(beta), y.data, s.data, p.data, defines=lrn_defines(before, after, beta))
        return y, (x, y, s, p, size, alpha, beta, before, after)

    def lrn_backward(self, dy, cache):
        x, y, s, p, size, alpha, beta, before, after = cache
        dy = self.rt.operand(dy, "lrn dy")
        if dy.shape != x.shape:
            raise ValueError(f"lrn_backward: dy {dy.shape} does not match the forward input {x.shape}")
        n, c, hw = x.shape[0], x.shape[1], x.shape[2] * x.shape[3]
        dx = self.rt.empty(x.shape)
        self._channel_walk("lrn_backward", n, c, hw, dy.data, x.data, y.data, s.data, p.data, i32(c), i32(hw),
                       i32(n), F32(2.0 * alpha * beta / size), dx.data, defines=lrn_defines(before, after, beta))
        return dx

    # An optimisation beside relu_* and lrn_*, which stay: ReLU then LRN as one kernel each way
    # (ops.cl: read the map once, write it once). The cache holds the ReLU's input x, not its
    # output, and s but not p = s^-beta: the backward recomputes both, so neither is ever written.
    def relu_lrn_forward(self, x, size=5, alpha=1e-4, beta=0.75, k=1.0):
        x = self.rt.operand(x, "relu_lrn x")
        if x.ndim != 4 or size < 1:
            raise ValueError(f"relu_lrn: expected an (N, C, H, W) input and size >= 1, got {x.shape} and {size}")
        before, after = size // 2, (size - 1) // 2
        n, c, hw = x.shape[0], x.shape[1], x.shape[2] * x.shape[3]
        y, s = self.rt.empty(x.shape), self.rt.empty(x.shape)
        self._planes("relu_lrn_forward", n, c, hw, x.data, i32(c), i32(hw), i32(n), F32(alpha / size), F32(k),
                       F32(beta), y.data, s.data, defines=lrn_defines(before, after, beta))
        return y, (x, y, s, size, alpha, beta, before, after)

    def relu_lrn_backward(self, dy, cache):
        x, y, s, size, alpha, beta, before, after = cache
        dy = self.rt.operand(dy, "relu_lrn dy")
        if dy.shape != x.shape:
            raise ValueError(f"relu_lrn_backward: dy {dy.shape} does not match the forward input {x.shape}")
        n, c, hw = x.shape[0], x.shape[1], x.shape[2] * x.shape[3]
        dx = self.rt.empty(x.shape)
        self._channel_walk("relu_lrn_backward", n, c, hw, dy.data, x.data, y.data, s.data, i32(c), i32(hw), i32(n),
                       F32(beta), F32(2.0 * alpha * beta / size), dx.data, defines=lrn_defines(before, after, beta))
        return dx

    def batchnorm_forward(
        self, x, gamma, beta, running_mean, running_var, training, momentum=0.1, eps=1e-5
    ):
        x = self.rt.operand(x, "batchnorm x")
        if x.ndim != 4:
            raise ValueError(f"batchnorm: expected an (N, C, H, W) input, got {x.shape}")
        gamma, beta = self.rt.operand(gamma, "batchnorm gamma"), self.rt.operand(beta, "batchnorm beta")
        running_mean = self.rt.operand(running_mean, "batchnorm running_mean", in_place=True)
        running_var = self.rt.operand(running_var, "batchnorm running_var", in_place=True)
        n, c, h, w = x.shape
        if any(a.shape != (c,) for a in (gamma, beta, running_mean, running_var)):
            raise ValueError(
                f"batchnorm: gamma, beta and the running statistics must be ({c},) for an input {x.shape}"
            )
        hw, m = h * w, n * h * w
        if training:
            require_batch_statistics(x.shape)
            mean = self._channel_sums(x, n, c, hw, divisor=m)
            var = self._channel_sums(x, n, c, hw, mode=2, center=mean, divisor=m)
            unbiased = momentum * m / max(m - 1, 1)  # the running variance is the unbiased one
            self.rt.launch("bn_update_running", c, running_mean.data, running_var.data, mean.data, var.data,
                           i32(c), F32(1 - momentum), F32(momentum), F32(unbiased))
        else:
            mean, var = running_mean, running_var
        invstd = self.rt.empty((c,))
        self.rt.launch("bn_invstd", c, var.data, F32(eps), i32(c), invstd.data)
        xhat, y = self.rt.empty(x.shape), self.rt.empty(x.shape)
        self._planes("bn_forward", n, c, hw, x.data, mean.data, invstd.data, gamma.data, beta.data, i32(c),
                       i32(hw), i32(n), xhat.data, y.data)
        return y, (xhat, gamma, invstd, training)

    def batchnorm_backward(self, dy, cache):
        xhat, gamma, invstd, training = cache
        dy = self.rt.operand(dy, "batchnorm dy")
        n, c, h, w = dy.shape
        hw = h * w
        dbeta = self._channel_sums(dy, n, c, hw)
        dgamma = self._channel_sums(dy, n, c, hw, mode=1, src2=xhat)
        dx = self.rt.empty(dy.shape)
        self._planes("bn_backward", n, c, hw, dy.data, xhat.data, gamma.data, invstd.data, dgamma.data,
                       dbeta.data, i32(training), F32(n * hw), i32(c), i32(hw), i32(n), dx.data)
        return dx, dgamma, dbeta

    # ---- pooling -----------------------------------------------------------------------
    # One work-item per output scans its window and keeps the first strict maximum in
    # row-major order -- the element numpy's separable max selects -- or its last NaN, as
    # torch does, and its position; backward is a gather over the windows that contain
    # each input (on CPUs, one work-item per plane, or several, scattering from the last window to
    # the first: the same sums in the same order).
    def maxpool_forward(self, x, kernel=2, stride=2, padding=0):
        x = self.rt.operand(x, "maxpool x")
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
        y, arg = self.rt.empty((n, c, oh, ow)), self.rt.empty((n, c, oh, ow), np.int32)
        geometry = (i32(h), i32(w), i32(oh), i32(ow), i32(n * c))
        window = f"-DPOOL={kernel} -DSTRIDE={stride} -DPAD={padding}"
        args = (x.data, *geometry, y.data, arg.data)
        if self.rows:  # optimisation (see ops.cl): a work-item walks a plane, its size compiled in
            group = self.pool_group(h, w, n * c)
            self.rt.launch("maxpool_forward_planes", cdiv(n * c, group), *args,
                           defines=plane_defines(window, h, w, group), rows=True)
        elif n * c <= 2:
            self.rt.launch("maxpool_forward", (ow, oh, n * c), *args, defines=window)
        else:  # optimisation (see ops.cl): the first and last plane simple, the rest branch-free
            for plane in (0, n * c - 1):
                self._launch_at("maxpool_forward", (ow, oh, 1), (0, 0, plane), args, window)
            self.rt.launch("maxpool_forward_inner", (ow, oh, n * c - 2), *args, defines=window)
        return y, (x.shape, arg, geometry, window)

    # An optimisation, the planes kernels' work-items: input elements one walks, in whole planes
    # (several small planes per item: PoCL pays per work-item, and conv2's are 256 elements).
    POOL_WALK = 4096

    def pool_group(self, h: int, w: int, planes: int) -> int:
        """Planes per work-item of the max pool planes kernels: about POOL_WALK elements, and at
        least 4 items per compute unit while there are planes for them."""
        per_unit = max(1, planes // (4 * self.rt.limits.compute_units))
        return max(1, min(self.POOL_WALK // (h * w), per_unit))

    def _launch_at(self, name, dims, offset, args, defines):
        """rt.launch of one block of a grid, at a global offset (the pool's first and last plane)."""
        knl, _ = self.rt.kernel(name, defines)
        self.rt.ran(name, knl(self.rt.queue, dims, None, *args, global_offset=offset))

    def maxpool_backward(self, dy, cache):
        x_shape, arg, geometry, window = cache
        dy = self.rt.operand(dy, "maxpool dy")
        if dy.shape != arg.shape:
            raise ValueError(f"maxpool_backward: dy {dy.shape} does not match the forward output {arg.shape}")
        dx = self.rt.empty(x_shape)
        n, c, h, w = x_shape
        args = (dy.data, arg.data, *geometry, dx.data)
        if self.rows:  # optimisation (see ops.cl): a work-item scatters a plane's dy, its size compiled in
            group = self.pool_group(h, w, n * c)
            self.rt.launch("maxpool_backward_planes", cdiv(n * c, group), *args,
                           defines=plane_defines(window, h, w, group), rows=True)
        else:
            self.rt.launch("maxpool_backward", (w, h, n * c), *args, defines=window)
        return dx

    # ---- dense ---------------------------------------------------------------------------
    def linear_forward(self, x, w, b):
        x, w, b = self.rt.operand(x, "linear x"), self.rt.operand(w, "linear w"), self.rt.operand(b, "linear b")
        n, d = x.shape[0], int(np.prod(x.shape[1:]))
        if w.ndim != 2 or w.shape[1] != d:
            raise ValueError(f"linear: input {x.shape} flattens to {d}, weights expect {w.shape[1:]}")
        mo = w.shape[0]
        if b.shape != (mo,):
            raise ValueError(f"linear: bias {b.shape} does not match weights {w.shape}: expected ({mo},)")
        y = self.rt.empty((n, mo))
        # y^T (M, N) = w (M, D) @ x^T (D, N), so the bias is per row; C(m, s) -> y[s, m]
        self.rt.gemm("linear_fwd", mo, n, d, AView(w.data, d, 1, d), lambda nb: self.rt.pack(x, d, n, 1, d, nb),
                     CView(y.data, 1, mo, n), bias=b)
        return y, (x, w)

    def linear_backward(self, dy, cache):
        x, w = cache
        dy = self.rt.operand(dy, "linear dy")
        n, (mo, d) = x.shape[0], w.shape
        if dy.shape != (n, mo):
            raise ValueError(f"linear_backward: dy {dy.shape} does not match the forward output {(n, mo)}")
        dx, dw = self.rt.empty(x.shape), self.rt.empty((mo, d))
        # dx (N, D) = dy (N, M) @ w (M, D)
        self.rt.gemm("linear_dx", n, d, mo, AView(dy.data, mo, 1, mo), lambda nb: self.rt.pack(w, mo, d, d, 1, nb),
                     CView.rows(dx.data, d))
        # dw (M, D) = dy^T (M, N) @ x (N, D)
        self.rt.gemm("linear_dw", mo, d, n, AView(dy.data, 1, mo, n), lambda nb: self.rt.pack(x, n, d, d, 1, nb),
                     CView.rows(dw.data, d))
        db = self.rt.reduce_rows(dy, mo, n, 1, (1, mo, 0))
        return dx, dw, db

    def softmax_cross_entropy(self, logits, labels):
        logits = self.rt.operand(logits, "softmax_cross_entropy logits")
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
        dev_labels = cla.to_device(self.rt.queue, labels.astype(np.int32), allocator=self.rt.pool)
        d, rows, loss = self.rt.empty((n, k)), self.rt.empty((n,)), self.rt.empty((1,))
        self.rt.launch("softmax_xent", n, logits.data, dev_labels.data, i32(n), i32(k), d.data, rows.data)
        self.rt.launch("mean_of", 1, rows.data, i32(n), loss.data)
        return float(loss.get()[0]), d

    # ---- optimiser -----------------------------------------------------------------------
    def sgd_update(self, param, grad, velocity, lr, momentum, weight_decay):
        param = self.rt.operand(param, "sgd_update param", in_place=True)
        velocity = self.rt.operand(velocity, "sgd_update velocity", in_place=True)
        grad = self.rt.operand(grad, "sgd_update grad")
        if not param.shape == grad.shape == velocity.shape:
            raise ValueError(
                f"sgd_update: param {param.shape}, grad {grad.shape} and velocity {velocity.shape} differ"
            )
        self._flat("sgd_update", param.size, param.data, grad.data, velocity.data, F32(lr), F32(momentum),
                       F32(weight_decay), i32(param.size))

    # ---- small helpers used by the sharded convolution --------------------------------------
    def take_kernels(self, w, start, stop):
        """Rows [start, stop) of w, as a new contiguous array (kernels take whole buffers)."""
        w = self.rt.operand(w, "take_kernels w")
        if not 0 <= start < stop <= w.shape[0]:
            raise ValueError(
                f"take_kernels: rows [{start}, {stop}) are not a non-empty range of {w.shape[0]}"
            )
        return w[start:stop].copy()
