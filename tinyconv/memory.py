"""How much memory a training step of the paper's network needs, and how much this machine has: the main
job refuses a run too large for the machine with both figures, rather than swap or be killed."""

from __future__ import annotations


def step_memory_bytes(
    conv1: int, conv2: int, batch_size: int, norm: str = "lrn", pool_kernel: int = 3, columns: bool = True,
    image_size: int = 32, num_classes: int = 10,
) -> int:  # fmt: skip
    """An estimate of a training step's peak memory for the paper's network, in bytes (float32).

    The parameters three times (weights, grads, momentum); the input and each layer's output for
    the batch, kept for the backward (LRN and batch norm keep a second map of their size, max pool
    its argmax); the largest of those twice more, as the gradients the backward holds at once;
    and, with ``columns``, each convolution's im2col columns, twice for the one that computes dX
    (the columns' gradient).
    """
    n, size, c_in = batch_size, image_size, 3
    pool_pad = 1 if pool_kernel == 3 else 0
    params = cols = 0
    maps = [n * c_in * size * size]
    for i, c in enumerate((conv1, conv2)):
        params += c * c_in * 25 + c
        if columns:
            cols += (2 if i > 0 else 1) * n * size * size * c_in * 25
        out = n * c * size * size
        maps += [out, out] + ([out, out] if norm != "none" else [])  # conv, ReLU, norm and its cache
        size = (size + 2 * pool_pad - pool_kernel) // 2 + 1
        maps += [n * c * size * size] * 2  # max pool and its argmax
        c_in = c
    params += conv2 * size * size * num_classes + num_classes
    return 4 * (3 * params + cols + sum(maps) + 2 * max(maps))


def available_memory_bytes() -> int | None:
    """The memory this machine can give a new allocation without swapping (Linux's MemAvailable), or
    None where it cannot tell."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def format_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover
