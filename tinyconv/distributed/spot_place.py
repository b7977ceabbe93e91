"""A convolution at one place of one image: what the spot check recomputes of a split by input channels every step
it pays for (``spot_views.ByChannels.at_one_place``), each a few thousand products where a sample is a whole image.

    output_at   y[:, r, c] = sum_(ch, a, b) w[:, ch, a, b] x[ch, r s + a - p, c s + b - p]      F outputs, C K K each
    dx_at       dx[:, r, c] = sum_(f, a, b) w[f, :, a, b] dy[f, (r + p - a) / s, (c + p - b) / s]  C of them, F K K each
                (the terms whose output index is whole and inside: those the output at (r, c) read)

Each comes with its terms' sizes, the same sum on |w| and |x| (or |dy|), which bound its round-off.
"""

from __future__ import annotations

import numpy as np


def output_at(w: np.ndarray, x: np.ndarray, r: int, c: int, stride: int, padding: int) -> tuple[np.ndarray, np.ndarray]:
    """w (F, C, K, K), one image x (C, H, W) -> (y (F,), its terms' sizes (F,)): the convolution, no bias, at output
    (r, c), from the window of x it reads, zero-padded by hand where it crosses the border."""
    k, (h, wd) = w.shape[-1], x.shape[1:]
    window = np.zeros((x.shape[0], k, k), np.float32)
    top, left = r * stride - padding, c * stride - padding
    y0, y1, x0, x1 = max(top, 0), min(top + k, h), max(left, 0), min(left + k, wd)
    window[:, y0 - top : y1 - top, x0 - left : x1 - left] = x[:, y0:y1, x0:x1]
    wf, v = w.reshape(len(w), -1), window.ravel()
    return wf @ v, np.abs(wf) @ np.abs(v)


def dx_at(w: np.ndarray, dy: np.ndarray, r: int, c: int, stride: int, padding: int) -> tuple[np.ndarray, np.ndarray]:
    """w (F, C, K, K), one image's output gradient dy (F, OH, OW) -> (dx (C,), its terms' sizes (C,)) at (r, c)."""
    f, channels, k, _ = w.shape
    oh, ow = dy.shape[1:]
    window = np.zeros((f, k, k), np.float32)  # dy where the outputs that read (r, c) are, kernel offset by offset
    for a in range(k):
        for b in range(k):
            y, x = r + padding - a, c + padding - b
            if y % stride == 0 and x % stride == 0 and 0 <= y // stride < oh and 0 <= x // stride < ow:
                window[:, a, b] = dy[:, y // stride, x // stride]
    wt, v = w.transpose(1, 0, 2, 3).reshape(channels, -1), window.ravel()
    return wt @ v, np.abs(wt) @ np.abs(v)
