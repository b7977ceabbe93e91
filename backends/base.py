"""The Backend interface: the short, enumerated list of ops a device must provide (docs/writing-a-backend.md).

A backend is one object per device, on *backend-native* arrays (numpy arrays, device buffers: each
exposes ``.shape``) converted only at the edges, ``asarray`` and ``to_numpy``. Every layer op is a pair,
``y, cache = op_forward(x, ...)`` and ``dx, ... = op_backward(dy, cache)``, the cache opaque. Tensors are
NCHW float32; conv weights (C_out, C_in, KH, KW), biases (C_out,); linear weights (D_out, D_in), a linear
input (N, ...) flattened to (N, D_in); labels a host int array (N,). Ops never modify their inputs, but
``sgd_update`` and ``batchnorm_forward`` in training, in place. The numpy backend is the reference,
against which ``backends.conformance.runner`` checks every other op by op.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import numpy as np

Array = Any  # a backend-native array
Cache = Any  # whatever a forward op keeps for its backward


def require_batch_statistics(x_shape: tuple[int, ...]) -> None:
    """Refuse training-mode batch norm of an (N, C, H, W) input with one value per channel: with
    N*H*W = 1 the batch variance is 0, every output would be beta and no gradient would flow (torch
    refuses it too)."""
    n, _, h, w = x_shape
    if n * h * w == 1:
        raise ValueError(
            f"batchnorm: expected more than 1 value per channel when training, got an input of shape "
            f"{tuple(x_shape)}, whose batch variance is 0; train with a batch of 2 or more, or use eval mode"
        )


def check_labels(labels: np.ndarray, n: int, k: int) -> None:
    """Refuse labels that are not (N,) ints in [0, K): a loss would read past a row of logits."""
    ints = labels.dtype.kind in "iu" or labels.size == 0
    if labels.shape != (n,) or not ints or labels.min(initial=0) < 0 or labels.max(initial=0) >= k:
        raise ValueError(f"labels must be {n} ints in [0, {k}), got shape {labels.shape} ({labels.dtype})")


def conv_output_size(size: int, kernel: int, stride: int, padding: int) -> int:
    """Output length of a window of ``kernel`` sliding with ``stride`` over ``size + 2*padding``."""
    out = (size + 2 * padding - kernel) // stride + 1
    if out <= 0:
        raise ValueError(
            f"a {kernel}x{kernel} window with stride {stride} and padding {padding} does not fit "
            f"an input of size {size}; use a smaller kernel, more padding or a larger input"
        )
    return out


class Backend(ABC):
    """Abstract device. Subclasses set ``name`` and implement every abstract op."""

    name: str = "abstract"
    # called, when set, between the steps of long first-run work (building kernels, timing an autotuner's
    # variants): a worker uses it to tell its master the compute goes on (transports.base.still_computing)
    progress: Callable[[], None] = staticmethod(lambda: None)

    # ---- edges -----------------------------------------------------------
    @abstractmethod
    def asarray(self, x: np.ndarray) -> Array:
        """Host float32/int array -> backend array (a copy on devices)."""

    @abstractmethod
    def to_numpy(self, x: Array) -> np.ndarray:
        """Backend array -> host numpy array."""

    @abstractmethod
    def zeros(self, shape: tuple[int, ...]) -> Array:
        """A float32 array of zeros of the given shape."""

    @abstractmethod
    def describe(self) -> dict[str, Any]:
        """Device facts for the worker handshake and run metadata: ``backend`` (str), ``device`` (str),
        ``kind`` ("cpu", "gpu", ...), ``compute_units`` (int), and any more."""

    def synchronize(self) -> None:  # noqa: B027 -- a no-op is right for host backends
        """Block until queued device work is done (for honest timings)."""

    # ---- convolution -------------------------------------------------------
    @abstractmethod
    def conv2d_forward(self, x: Array, w: Array, b: Array, stride: int = 1, padding: int = 0) -> tuple[Array, Cache]:
        """x (N, C, H, W), w (F, C, KH, KW), b (F,) -> y (N, F, OH, OW).

        OH = (H + 2*padding - KH) // stride + 1, likewise OW.
        y[n, f] = b[f] + sum_c x_pad[n, c] (cross-correlated with) w[f, c].
        """

    @abstractmethod
    def conv2d_backward(self, dy: Array, cache: Cache, need_dx: bool = True) -> tuple[Array | None, Array, Array]:
        """dy (N, F, OH, OW) -> (dx (N, C, H, W) or None, dw (F, C, KH, KW), db (F,))."""

    def conv2d_partial(self, x: Array, w: Array, stride: int = 1, padding: int = 0) -> tuple[np.ndarray, Cache]:
        """x (N, C, H, W), w (F, C, KH, KW) -> (P (F, N, OH, OW) on the host, the cache conv2d_backward takes).

        P[f, n] = sum_c x_pad[n, c] (cross-correlated with) w[f, c]: conv2d_forward's y with no bias,
        kernel-major, so that a range of kernels is one contiguous block (what a participant of a layer
        split by its input channels sends: tinyconv/distributed/shard/by_channels.py). A backend whose
        GEMM leaves y kernel-major returns it as it is (the numpy backend)."""
        y, cache = self.conv2d_forward(x, w, self.zeros((w.shape[0],)), stride, padding)
        return np.ascontiguousarray(self.to_numpy(y).transpose(1, 0, 2, 3)), cache

    # ---- elementwise and normalisation --------------------------------------
    @abstractmethod
    def relu_forward(self, x: Array) -> tuple[Array, Cache]:
        """y = max(x, 0), any shape."""

    @abstractmethod
    def relu_backward(self, dy: Array, cache: Cache) -> Array:
        """dx = dy * [x > 0]."""

    @abstractmethod
    def lrn_forward(
        self, x: Array, size: int = 5, alpha: float = 1e-4, beta: float = 0.75, k: float = 1.0
    ) -> tuple[Array, Cache]:
        """Cross-channel local response norm, torch.nn.LocalResponseNorm semantics and defaults.

        x (N, C, H, W) -> y = x / (k + alpha/size * sum_{c' in window(c)} x[c']^2)^beta,
        window(c) = [c - size//2, c + (size-1)//2], clipped to [0, C).
        """

    @abstractmethod
    def lrn_backward(self, dy: Array, cache: Cache) -> Array:
        """dx (N, C, H, W) for lrn_forward."""

    # An optimisation beside the plain ops: ReLU then LRN as one op, so that a device reads the map
    # once and writes it once. The default, the composition, is what every override is checked against.
    def relu_lrn_forward(
        self, x: Array, size: int = 5, alpha: float = 1e-4, beta: float = 0.75, k: float = 1.0
    ) -> tuple[Array, Cache]:
        """y = lrn(relu(x)): ``lrn_forward(relu_forward(x)[0], size, alpha, beta, k)``, x and y (N, C, H, W).

        With r = max(x, 0) and the LRN of ``lrn_forward`` on r:
            s_i = k + (alpha / size) * sum_{j in W(i)} r_j^2,      y_i = r_i * s_i^(-beta)
        """
        r, relu_cache = self.relu_forward(x)
        y, lrn_cache = self.lrn_forward(r, size, alpha, beta, k)
        return y, (relu_cache, lrn_cache)

    def relu_lrn_backward(self, dy: Array, cache: Cache) -> Array:
        """dx (N, C, H, W) for relu_lrn_forward: ``relu_backward(lrn_backward(dy))``, the chain rule
        through both. With W'(j) = [j - (size-1)//2, j + size//2] the mirrored window:
            dr_j = dy_j s_j^(-beta) - (2 alpha beta / size) r_j * sum_{i in W'(j)} dy_i y_i / s_i
            dx_j = dr_j * [r_j > 0]
        """
        relu_cache, lrn_cache = cache
        return self.relu_backward(self.lrn_backward(dy, lrn_cache), relu_cache)

    @abstractmethod
    def batchnorm_forward(
        self,
        x: Array,
        gamma: Array,
        beta: Array,
        running_mean: Array,
        running_var: Array,
        training: bool,
        momentum: float = 0.1,
        eps: float = 1e-5,
    ) -> tuple[Array, Cache]:
        """Per-channel batch norm over (N, H, W). x (N, C, H, W), gamma/beta (C,).

        Training: normalise with the batch statistics (biased variance) and update running_mean /
        running_var *in place*, PyTorch style: r <- (1 - momentum) r + momentum * batch_stat
        (unbiased variance for r); one value per channel (N*H*W == 1) raises ValueError before
        touching anything (``require_batch_statistics``). Eval: the running statistics (any N*H*W).
        """

    @abstractmethod
    def batchnorm_backward(self, dy: Array, cache: Cache) -> tuple[Array, Array, Array]:
        """dy (N, C, H, W) -> (dx, dgamma (C,), dbeta (C,))."""

    # ---- pooling ----------------------------------------------------------
    @abstractmethod
    def maxpool_forward(self, x: Array, kernel: int = 2, stride: int = 2, padding: int = 0) -> tuple[Array, Cache]:
        """x (N, C, H, W) -> y (N, C, OH, OW), OH = (H + 2*padding - kernel)//stride + 1.

        Padding is -inf (never selected). Ties go to the first maximum in row-major window order. NaN
        propagates as in torch's max_pool2d: a window holding a NaN outputs NaN and selects its *last*
        NaN in row-major order (torch's loop: ``if (val > maxval || isnan(val)) select val``).
        """

    @abstractmethod
    def maxpool_backward(self, dy: Array, cache: Cache) -> Array:
        """dx (N, C, H, W): each dy goes to its window's selected input, summed (a NaN
        window's dy to its last NaN)."""

    # ---- dense ------------------------------------------------------------
    @abstractmethod
    def linear_forward(self, x: Array, w: Array, b: Array) -> tuple[Array, Cache]:
        """x (N, ...) flattened to (N, D), w (M, D), b (M,) -> y (N, M) = x w^T + b."""

    @abstractmethod
    def linear_backward(self, dy: Array, cache: Cache) -> tuple[Array, Array, Array]:
        """dy (N, M) -> (dx in x's original shape, dw (M, D), db (M,))."""

    @abstractmethod
    def softmax_cross_entropy(self, logits: Array, labels: np.ndarray) -> tuple[float, Array]:
        """logits (N, K), labels (N,) ints in [0, K) -> (mean loss, dlogits (N, K))."""

    # ---- optimiser ----------------------------------------------------------
    @abstractmethod
    def sgd_update(
        self, param: Array, grad: Array, velocity: Array, lr: float, momentum: float, weight_decay: float
    ) -> None:
        """In place, PyTorch SGD semantics:
        g = grad + weight_decay * param;  v = momentum * v + g;  param -= lr * v.
        """

    # ---- small helpers used by the sharded convolution ----------------------
    def take_kernels(self, w: Array, start: int, stop: int) -> Array:
        """Rows [start, stop) of a (F, ...) weight or (F,) bias array."""
        return w[start:stop]

    def __repr__(self) -> str:
        d = self.describe()
        return f"<{type(self).__name__} {d.get('device', '?')}>"


@runtime_checkable
class WireConversion(Protocol):
    """Optional, beside the Backend contract: a backend that converts wire words (``--wire-precision``)
    on its device rather than leave it to the host (tinyconv/distributed/wire_codec.py), so only the
    narrow words cross the device's link. None means "not here": the host converts.
    """

    def narrow_wire(self, x: Array, fmt: str) -> tuple[np.ndarray, bool] | None:
        """x (any shape, float32, on this backend) -> (the host array x travels as in ``fmt``, the
        very words ``wire_precision.narrow(to_numpy(x), fmt).carried`` holds; whether a finite number
        became infinite: then the caller sends x in float32, as ``narrow`` does), or None."""
        ...

    def widen_wire(self, carried: np.ndarray, fmt: str) -> Array | None:
        """A host array in ``fmt`` as it came off the wire (checked) -> float32 on this backend,
        bit for bit ``asarray(wire_precision.widen(carried, fmt))``, or None."""
        ...
