"""Layers with hand-written backprop, each a thin stateful wrapper over Backend ops.

The uniform contract (CS231n's layers.py, made stateful so a network is a list):

    y  = layer.forward(x, training)   # keeps what backward needs; training=False by default
    dx = layer.backward(dy)           # fills layer.grads, same keys as layer.params
    layer.output_shape(x_shape)       # y's shape, without computing it

Shapes are NCHW float32. Each backward's math is written in the docstring of its
backend op pair here, next to the forward it differentiates; the numbers are
computed by the backend (``backends/numpy_backend.py`` is the readable reference).
``tinyconv/gradcheck.py`` checks every one against centred finite differences.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from backends.base import Array, Backend, conv_output_size


def he_init(rng: np.random.Generator, shape: tuple[int, ...], fan_in: int) -> np.ndarray:
    """He (Kaiming) normal, N(0, 2 / fan_in), float32: keeps the activations' variance through a ReLU."""
    return (rng.standard_normal(shape) * np.sqrt(2.0 / fan_in)).astype(np.float32)


class Layer:
    """Base: no parameters, no state. ``params``/``grads`` map names to backend arrays; ``name`` keys
    the parameters in optimisers and checkpoints ("conv1.w"), given by the Network (``kind`` + order)."""

    kind = "layer"

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.name = ""
        self.params: dict[str, Array] = {}
        self.grads: dict[str, Array] = {}
        self.buffers: dict[str, Array] = {}  # state that is saved but not trained
        self.decay: set[str] = set()  # parameter names that get weight decay
        self.cache: Any = None

    def forward(self, x: Array, training: bool = False) -> Array:
        raise NotImplementedError

    def backward(self, dy: Array) -> Array | None:
        raise NotImplementedError

    def output_shape(self, x_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The output's shape for an input of ``x_shape``: the same, unless the layer says otherwise."""
        return tuple(x_shape)

    def leaves(self) -> list[Layer]:
        """The layers whose params, grads and buffers this one stands for: itself, or those it is made of."""
        return [self]

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Conv2D(Layer):
    """x (N, C, H, W) -> y (N, F, OH, OW) with w (F, C, K, K), b (F,).

    Forward:  y[n,f,p] = b[f] + sum_{c,i,j} w[f,c,i,j] * x_pad[n, c, p*s + (i,j)]
    Backward (dy (N, F, OH, OW)):
        db[f]       = sum_{n,p} dy[n,f,p]
        dw[f,c,i,j] = sum_{n,p} dy[n,f,p] * x_pad[n, c, p*s + (i,j)]
        dx          = the same sum scattered back: each x_pad element receives
                      w[f,c,i,j] * dy[n,f,p] from every window it sat in.
    In im2col form, with cols (C*K*K, N*OH*OW): y = W cols, dW = dY cols^T,
    dcols = W^T dY, and dx = col2im(dcols).

    ``need_dx=False`` (the first layer) skips the dX GEMM entirely.
    Weights start He-initialised from ``rng`` (a fresh generator if None), biases at 0.
    """

    kind = "conv"

    def __init__(
        self,
        backend: Backend,
        in_channels: int,
        out_channels: int,
        kernel: int,
        stride: int = 1,
        padding: int = 0,
        need_dx: bool = True,
        rng: np.random.Generator | None = None,
    ) -> None:
        super().__init__(backend)
        self.in_channels, self.out_channels = in_channels, out_channels
        self.kernel, self.stride, self.padding = kernel, stride, padding
        self.need_dx = need_dx
        rng = rng if rng is not None else np.random.default_rng()
        fan_in = in_channels * kernel * kernel
        self.params = {
            "w": backend.asarray(he_init(rng, (out_channels, in_channels, kernel, kernel), fan_in)),
            "b": backend.zeros((out_channels,)),
        }
        self.decay = {"w"}

    def forward(self, x, training=False):
        y, self.cache = self.backend.conv2d_forward(x, self.params["w"], self.params["b"], self.stride, self.padding)
        return y

    def backward(self, dy):
        dx, dw, db = self.backend.conv2d_backward(dy, self.cache, self.need_dx)
        self.grads = {"w": dw, "b": db}
        return dx

    def output_shape(self, x_shape):
        n, _, h, w = x_shape
        return (n, self.out_channels, *(conv_output_size(s, self.kernel, self.stride, self.padding) for s in (h, w)))

    def __repr__(self):
        return (
            f"Conv2D({self.in_channels}->{self.out_channels}, {self.kernel}x{self.kernel}, "
            f"stride {self.stride}, pad {self.padding})"
        )


class ReLU(Layer):
    """y = max(x, 0).  Backward: dx = dy * [x > 0] (the subgradient 0 at x = 0)."""

    kind = "relu"

    def forward(self, x, training=False):
        y, self.cache = self.backend.relu_forward(x)
        return y

    def backward(self, dy):
        if isinstance(self.cache, Fused):  # the LRN after it ran the pair's backward, this mask included
            return dy
        return self.backend.relu_backward(dy, self.cache)


class LocalResponseNorm(Layer):
    """Cross-channel LRN with torch.nn.LocalResponseNorm's semantics and defaults
    (alpha 1e-4, beta 0.75, k 1; torch has no default size, this layer's is 5).

    Forward, for channel i with window W(i) = [i - n//2, i + (n-1)//2] (clipped):
        s_i = k + (alpha / n) * sum_{j in W(i)} x_j^2,      y_i = x_i * s_i^(-beta)

    Backward. y_i depends on x_j for *every* j in W(i), not just on x_i -- the
    classic trap is to keep only the diagonal term. By the product rule:
        dy_i/dx_j = [i = j] s_i^(-beta) - beta x_i s_i^(-beta-1) * (alpha/n) * 2 x_j [j in W(i)]
    so
        dx_j = dy_j s_j^(-beta) - (2 alpha beta / n) x_j * sum_{i : j in W(i)} dy_i y_i / s_i
    using x_i s_i^(-beta-1) = y_i / s_i. The set {i : j in W(i)} is the window
    mirrored, [j - (n-1)//2, j + n//2]; for odd n it is W(j) itself.
    """

    kind = "lrn"

    def __init__(self, backend, size=5, alpha=1e-4, beta=0.75, k=1.0):
        super().__init__(backend)
        self.size, self.alpha, self.beta, self.k = size, alpha, beta, k

    def forward(self, x, training=False):
        y, self.cache = self.backend.lrn_forward(x, self.size, self.alpha, self.beta, self.k)
        return y

    def backward(self, dy):
        if isinstance(self.cache, Fused):  # forward ran with the ReLU before it: both backwards at once
            return self.backend.relu_lrn_backward(dy, self.cache.cache)
        return self.backend.lrn_backward(dy, self.cache)

    def __repr__(self):
        return f"LocalResponseNorm(size={self.size}, alpha={self.alpha}, beta={self.beta}, k={self.k})"


# An optimisation beside the layers, which stay as they are: a ReLU directly followed by an LRN runs
# as one backend op (Backend.relu_lrn_forward), which a device backend fuses into one pass over the map
# each way. Each layer's backward then sees a Fused cache: the LRN's runs both backwards at once
# (relu_lrn_backward), the ReLU's passes its gradient through. The numbers stay the same.


@dataclass
class Fused:
    """A layer's cache after :func:`relu_lrn_forward`: the op's cache on the LRN, None on the ReLU."""

    cache: Any = None


def relu_then_lrn(first: Layer, second: Layer) -> bool:
    """A plain ReLU then a plain LocalResponseNorm (not subclasses, which may compute something else)."""
    return type(first) is ReLU and type(second) is LocalResponseNorm


def relu_lrn_forward(relu: ReLU, lrn: LocalResponseNorm, x: Array) -> Array:
    """``lrn.forward(relu.forward(x))`` as one op, x (N, C, H, W); then ``lrn.backward`` and
    ``relu.backward``, in that order as always, give the pair's gradient."""
    y, cache = lrn.backend.relu_lrn_forward(x, lrn.size, lrn.alpha, lrn.beta, lrn.k)
    lrn.cache, relu.cache = Fused(cache), Fused()
    return y


class BatchNorm2D(Layer):
    """Per-channel batch norm over (N, H, W); m = N*H*W values per channel.

    Forward (training): mu, var = batch mean and biased variance,
        xhat = (x - mu) / sqrt(var + eps),   y = gamma * xhat + beta;
    running statistics r <- (1 - momentum) r + momentum * stat (unbiased var).
    Eval mode uses the running statistics instead, so it is a fixed affine map.

    Backward (training), since mu and var depend on every x of the channel:
        dbeta  = sum dy,    dgamma = sum dy * xhat
        dx     = gamma / sqrt(var + eps) * (dy - dbeta/m - xhat * dgamma/m)
    Eval: dx = gamma / sqrt(running_var + eps) * dy.

    As in torch, a training batch with one value per channel (N*H*W = 1) is refused: its
    variance is 0 and xhat would be 0/0.
    """

    kind = "bn"

    def __init__(self, backend, channels, momentum=0.1, eps=1e-5):
        super().__init__(backend)
        self.channels, self.momentum, self.eps = channels, momentum, eps
        self.params = {
            "gamma": backend.asarray(np.ones(channels, np.float32)),
            "beta": backend.zeros((channels,)),
        }
        self.buffers = {
            "running_mean": backend.zeros((channels,)),
            "running_var": backend.asarray(np.ones(channels, np.float32)),
        }

    def forward(self, x, training=False):
        p, b = self.params, self.buffers
        y, self.cache = self.backend.batchnorm_forward(
            x, p["gamma"], p["beta"], b["running_mean"], b["running_var"], training, self.momentum, self.eps
        )
        return y

    def backward(self, dy):
        dx, dgamma, dbeta = self.backend.batchnorm_backward(dy, self.cache)
        self.grads = {"gamma": dgamma, "beta": dbeta}
        return dx

    def __repr__(self):
        return f"BatchNorm2D({self.channels})"


class MaxPool2D(Layer):
    """y[n,c,p] = max of x over the window of output position p (padding is -inf).

    Backward: the max is piecewise the identity on one input, so dy[n,c,p] goes
    to the input that was selected (the first maximum on ties) and nowhere else.
    With overlapping windows (kernel > stride) one input can win several windows
    and then receives the *sum* of their gradients -- the case a weak test misses.
    A NaN wins its window, as in torch: the output is NaN and the gradient goes to it.
    """

    kind = "pool"

    def __init__(self, backend, kernel=2, stride=2, padding=0):
        super().__init__(backend)
        self.kernel, self.stride, self.padding = kernel, stride, padding

    def forward(self, x, training=False):
        y, self.cache = self.backend.maxpool_forward(x, self.kernel, self.stride, self.padding)
        return y

    def backward(self, dy):
        return self.backend.maxpool_backward(dy, self.cache)

    def output_shape(self, x_shape):
        n, c, h, w = x_shape
        return (n, c, *(conv_output_size(s, self.kernel, self.stride, self.padding) for s in (h, w)))

    def __repr__(self):
        return f"MaxPool2D({self.kernel}x{self.kernel}, stride {self.stride}, pad {self.padding})"


class Linear(Layer):
    """x (N, ...) flattened to (N, D) -> y (N, M) = x w^T + b, w (M, D), b (M,).

    Backward: dx = dy w (reshaped to x's shape), dw = dy^T x, db = sum_n dy.
    Weights start He-initialised from ``rng`` (a fresh generator if None), biases at 0.
    """

    kind = "fc"

    def __init__(self, backend, in_features, out_features, rng=None):
        super().__init__(backend)
        self.in_features, self.out_features = in_features, out_features
        rng = rng if rng is not None else np.random.default_rng()
        self.params = {
            "w": backend.asarray(he_init(rng, (out_features, in_features), in_features)),
            "b": backend.zeros((out_features,)),
        }
        self.decay = {"w"}

    def forward(self, x, training=False):
        y, self.cache = self.backend.linear_forward(x, self.params["w"], self.params["b"])
        return y

    def backward(self, dy):
        dx, dw, db = self.backend.linear_backward(dy, self.cache)
        self.grads = {"w": dw, "b": db}
        return dx

    def output_shape(self, x_shape):
        return (x_shape[0], self.out_features)

    def __repr__(self):
        return f"Linear({self.in_features}->{self.out_features})"


class SoftmaxCrossEntropy:
    """Mean cross-entropy of softmax(logits) against integer labels, optionally label-smoothed.

    Forward, stably: z = logits - max(logits), loss = mean_n (log sum_k e^z[n,k] - z[n, y_n]).
    Backward: dlogits = (softmax(logits) - onehot(y)) / N.

    With ``smoothing`` eps > 0 the target is q = (1 - eps) onehot(y) + eps / K over the K classes
    (torch's ``CrossEntropyLoss(label_smoothing=eps)``)::

        loss_eps    = (1 - eps) loss + eps mean_n (log sum_k e^z[n,k] - mean_k z[n,k])
        dlogits_eps = (softmax(logits) - q) / N = dlogits + eps (onehot(y) - 1/K) / N

    The backend computes the plain pair; the smoothing's terms are added on the host, where the
    logits (N x K, K = 10) cost nothing to read.
    """

    def __init__(self, backend: Backend, smoothing: float = 0.0) -> None:
        if not 0.0 <= smoothing < 1.0:
            raise ValueError(f"label smoothing must be in [0, 1), got {smoothing!r}")
        self.backend = backend
        self.smoothing = smoothing

    def __call__(self, logits: Array, labels: np.ndarray) -> tuple[float, Array]:
        loss, dlogits = self.backend.softmax_cross_entropy(logits, labels)
        eps = self.smoothing
        if eps == 0.0:
            return loss, dlogits
        z = self.backend.to_numpy(logits).astype(np.float64)
        n, k = z.shape
        top = z.max(axis=1)
        uniform = np.mean(top + np.log(np.exp(z - top[:, None]).sum(axis=1)) - z.mean(axis=1))
        d = self.backend.to_numpy(dlogits)
        host = d is dlogits  # the op's own array on a host backend (float64 ones in the gradient checker)
        d = d if host else d.copy()
        d -= d.dtype.type(eps / (k * n))
        d[np.arange(n), np.asarray(labels)] += d.dtype.type(eps / n)
        return (1.0 - eps) * loss + eps * float(uniform), d if host else self.backend.asarray(d)
