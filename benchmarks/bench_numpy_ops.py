#!/usr/bin/env python3
"""Median time of the numpy backend's non-convolution ops on the paper's maps (300:1000's, or --arch's).

    taskset -c 1 env OPENBLAS_NUM_THREADS=1 python benchmarks/bench_numpy_ops.py
    python benchmarks/bench_numpy_ops.py --baseline /tmp/old/numpy_backend.py   # side by side
    python benchmarks/bench_numpy_ops.py --arch 50:500 --batch-size 256         # bench_train_step.py's maps
    python benchmarks/bench_numpy_ops.py --ops maxpool,maxpool-nan --repeats 15  # some ops only
    python benchmarks/bench_numpy_ops.py --ops sgd --sgd-arch 500:1500           # the update alone

The shapes are those of a training step of the ``--arch`` network (default 300:1000)
at ``--batch-size`` (default 64): the conv1 map Nx300x32x32 and the conv2 map
Nx1000x16x16, each through ReLU, LRN (or batch norm) and a 3x3 stride-2 pad-1 max
pool; "maxpool-nan" is the max pool of the same map with one NaN in about 10^4 values
(the path a diverging run takes), not counted in the totals: relu+lrn+maxpool (the LRN
network's layers) and relu+batchnorm+maxpool (the batch-norm network's), each printed when
all its ops are timed. "im2col" and "col2im" time the module's functions on the
columns of conv2 of the 48:96 network at batch 128 (x 128x48x16x16, 5x5, padding 2), not
counted in the total either. "sgd" is one optimiser step over every parameter of the ``--sgd-arch``
network (momentum 0.9, weight decay 5e-4): sgd_update_plain, the backend's blocked sgd_update and,
if PyTorch is installed, torch.optim.SGD on the same arrays (not in the totals). Every call allocates its
outputs afresh, as in training, and the process keeps its freed memory for reuse, as training does
(tinyconv/distributed/heap.py; --keep-freed-memory off: glibc's default, each fresh map faulted in).
``--baseline FILE`` loads ``NumpyBackend`` from another copy of numpy_backend.py, with the
numpy_maxpool.py and numpy_columns.py beside it if they are there (``mkdir /tmp/old; git show
HEAD:backends/numpy_backend.py > /tmp/old/numpy_backend.py``, the same for the other two), and times
it on the same inputs, so a before/after table is one command. Not a test: no asserts.
"""

from __future__ import annotations

import gc
import importlib.util
import inspect
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

import backends  # noqa: E402
from backends.numpy_backend import NumpyBackend  # noqa: E402
from tinyconv.distributed.heap import keep_freed_memory  # noqa: E402
from tinyconv.model import parse_arch  # noqa: E402
from tinyconv.options import Parser, UsageError, add, arch  # noqa: E402
from tinyconv.report import format_table  # noqa: E402

SIBLINGS = ("numpy_maxpool", "numpy_columns")  # the modules numpy_backend.py imports ops from
CONV_X, CONV_K, CONV_PAD = (128, 48, 16, 16), 5, 2  # conv2 of 48:96 at batch 128: 1200 x 32768 columns


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_module(path: str):
    """Another copy of numpy_backend.py, as a module; it imports the SIBLINGS beside it, where there are
    any, in place of today's."""
    today = {sib: sys.modules[f"backends.{sib}"] for sib in SIBLINGS}
    try:
        for sib in SIBLINGS:
            if (Path(path).parent / f"{sib}.py").exists():
                sys.modules[f"backends.{sib}"] = old = _load(Path(path).parent / f"{sib}.py", f"baseline_{sib}")
                setattr(backends, sib, old)
        return _load(Path(path), "baseline_numpy_backend")
    finally:
        for sib, mod in today.items():
            sys.modules[f"backends.{sib}"] = mod
            setattr(backends, sib, mod)


def column_calls(module, x: np.ndarray, dcols: np.ndarray, ops: list[str]) -> dict[str, Callable[[], object]]:
    """{"im2col": call, "col2im": call} of one module's functions on conv2's columns. col2im is
    called as conv2d_backward calls it: allowed to zero dcols' terms that fall into the padding
    where it takes that keyword (doing so again leaves them and the result as they are)."""
    calls: dict[str, Callable[[], object]] = {}
    if "im2col" in ops:
        calls["im2col"] = lambda: module.im2col(x, CONV_K, CONV_K, 1, CONV_PAD)
    if "col2im" in ops:
        col2im = module.col2im
        kwargs = {"overwrite_dcols": True} if "overwrite_dcols" in inspect.signature(col2im).parameters else {}

        def run() -> object:
            return col2im(dcols, x.shape, CONV_K, CONV_K, 1, CONV_PAD, **kwargs)

        calls["col2im"] = run
    return calls


def sgd_calls(modules: dict, arch: str) -> dict[str, Callable[[], object]]:
    """One update of every parameter of the ``arch`` network: each module's sgd_update (and the plain one
    of the newest), and torch.optim.SGD's (foreach) on copies of the same arrays, if torch is here."""
    from tinyconv.model import paper_net

    rng = np.random.default_rng(1)
    params = [a.copy() for _, layer, name in paper_net(arch).named_params() for a in [layer.params[name]]]
    grads = [rng.standard_normal(a.shape, dtype=np.float32) for a in params]
    velocity = [np.zeros_like(a) for a in params]
    lr, momentum, wd = 0.01, 0.9, 5e-4

    def update(fn) -> Callable[[], object]:
        return lambda: [fn(p, g, v, lr, momentum, wd) for p, g, v in zip(params, grads, velocity, strict=True)]

    calls = {f"sgd {name}": update(m.sgd_update) for name, m in modules.items() if hasattr(m, "sgd_update")}
    if hasattr(modules["now"], "sgd_update_plain"):
        calls["sgd plain"] = update(modules["now"].sgd_update_plain)
    try:
        import torch
    except ImportError:
        return calls
    torch.set_num_threads(1)
    tp = [torch.tensor(a) for a in params]
    for t, g in zip(tp, grads, strict=True):
        t.grad = torch.tensor(g)
    opt = torch.optim.SGD(tp, lr=lr, momentum=momentum, weight_decay=wd)
    calls["sgd torch"] = opt.step
    return calls


def medians_ms(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median ms of each function; calls interleave, so all share the machine's noise alike."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()  # warm-up
    for _ in range(repeats):
        for name, fn in fns.items():
            gc.collect()
            t = time.perf_counter()
            out = fn()
            times[name].append(time.perf_counter() - t)
            del out  # free before the next call, as a training step frees its temporaries
    return {name: 1e3 * float(np.median(ts)) for name, ts in times.items()}


OPS = ("relu", "lrn", "batchnorm", "maxpool", "maxpool-nan", "im2col", "col2im", "sgd")
COLUMN_OPS = ("im2col", "col2im")
TOTALS = (("relu", "lrn", "maxpool"), ("relu", "batchnorm", "maxpool"))  # each network's layers: the Amdahl part


def op_calls(
    be, x: np.ndarray, x_nan: np.ndarray, dy: np.ndarray, dy_pool: np.ndarray, ops: list[str]
) -> dict[str, Callable[[], object]]:
    """{"relu fwd": call, "relu bwd": call, ...} on one input map; backward calls get their cache now."""
    c = x.shape[1]
    gamma, beta = np.ones(c, np.float32), np.zeros(c, np.float32)
    rm, rv = np.zeros(c, np.float32), np.ones(c, np.float32)
    forwards = {
        "relu": (lambda: be.relu_forward(x), be.relu_backward, dy),
        "lrn": (lambda: be.lrn_forward(x), be.lrn_backward, dy),
        "batchnorm": (lambda: be.batchnorm_forward(x, gamma, beta, rm, rv, True), be.batchnorm_backward, dy),
        "maxpool": (lambda: be.maxpool_forward(x, 3, 2, 1), be.maxpool_backward, dy_pool),
        "maxpool-nan": (lambda: be.maxpool_forward(x_nan, 3, 2, 1), be.maxpool_backward, dy_pool),
    }
    calls = {}
    for op in ops:
        forward, backward, grad = forwards[op]
        cache = forward()[1]
        calls[f"{op} fwd"] = forward
        calls[f"{op} bwd"] = lambda backward=backward, grad=grad, cache=cache: backward(grad, cache)
    return calls


def map_rows(backends: dict, shapes: dict, map_ops: list[str], repeats: int, rng, totals: dict) -> list:
    """The rows of the ops on the conv maps (none without ``map_ops``), adding each op's time to ``totals[op]``."""
    rows = []
    for label, shape in shapes.items() if map_ops else ():
        x = rng.standard_normal(shape, dtype=np.float32)
        x_nan = np.where(rng.random(shape, dtype=np.float32) < 1e-4, np.float32(np.nan), x)
        dy = rng.standard_normal(shape, dtype=np.float32)
        n, c, h, w = shape
        dy_pool = rng.standard_normal((n, c, (h - 1) // 2 + 1, (w - 1) // 2 + 1), dtype=np.float32)
        calls = {name: op_calls(be, x, x_nan, dy, dy_pool, map_ops) for name, be in backends.items()}
        for op in calls["now"]:
            ms = medians_ms({name: calls[name][op] for name in backends}, repeats)
            stem = op.rsplit(" ", 1)[0]
            for name in backends:
                totals[name][stem] = totals[name].get(stem, 0.0) + ms[name]
            row = (label, op, *(round(ms[name], 1) for name in backends))
            rows.append(row + ((f"{ms['baseline'] / ms['now']:.2f}x",) if "baseline" in backends else ()))
        del calls
        del x, x_nan, dy, dy_pool
    return rows


def build_parser() -> Parser:
    p = Parser(description=__doc__.split("\n\n")[0])
    add(
        p,
        "arch",
        "batch_size",
        "repeats",
        defaults={"arch": "300:1000", "batch_size": 64, "repeats": 7},
        helps={"arch": "the maps' channels", "repeats": "calls of each op, interleaved"},
    )
    p.add_argument(
        "--keep-freed-memory",
        choices=("on", "off"),
        default="on",
        help="keep freed memory for reuse, as training does (tinyconv/distributed/heap.py); off: glibc's default",
    )
    p.add_argument("--baseline", metavar="FILE", help="another numpy_backend.py to time side by side")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated, of {', '.join(OPS)} (default: all)")
    p.add_argument(
        "--sgd-arch", type=arch, default="300:1000", metavar="C1:C2", help="the network whose parameters 'sgd' updates"
    )
    return p


def main() -> None:
    p = build_parser()
    args = p.parse_args()
    ops = args.ops.split(",")
    if not set(ops) <= set(OPS):
        p.error(f"unknown ops {sorted(set(ops) - set(OPS))}; choose from {', '.join(OPS)}")

    if args.keep_freed_memory == "on":
        keep_freed_memory()
    c1, c2 = parse_arch(args.arch)
    shapes = {"conv1 map": (args.batch_size, c1, 32, 32), "conv2 map": (args.batch_size, c2, 16, 16)}
    modules = {"now": sys.modules[NumpyBackend.__module__]}
    if args.baseline:
        modules = {"baseline": load_module(args.baseline), **modules}
    backends = {name: module.NumpyBackend() for name, module in modules.items()}

    rng = np.random.default_rng(0)
    totals: dict[str, dict[str, float]] = {name: {} for name in backends}
    map_ops = [op for op in ops if op not in COLUMN_OPS and op != "sgd"]
    rows = map_rows(backends, shapes, map_ops, args.repeats, rng, totals)
    if set(ops) & set(COLUMN_OPS):
        x = rng.standard_normal(CONV_X, dtype=np.float32)
        dcols = rng.standard_normal((CONV_X[1] * CONV_K**2, CONV_X[0] * CONV_X[2] * CONV_X[3]), dtype=np.float32)
        calls = {name: column_calls(module, x, dcols, ops) for name, module in modules.items()}
        for op in calls["now"]:
            ms = medians_ms({name: calls[name][op] for name in modules}, args.repeats)
            row = ("48:96 conv2 cols", op, *(round(ms[name], 1) for name in modules))
            if args.baseline:
                row += (f"{ms['baseline'] / ms['now']:.2f}x",)
            rows.append(row)
        del calls, x, dcols
    if "sgd" in ops:
        calls = sgd_calls(modules, args.sgd_arch)
        ms = medians_ms(calls, args.repeats)
        peer = ms.get("sgd torch")
        for name, t in ms.items():  # one time a row, in the last column; the ratio against torch's beside it
            ratio = f"torch/this {peer / t:.2f}x" if peer else "no torch"
            rows.append((f"{args.sgd_arch} params", f"{name} ({ratio})", *([""] * (len(backends) - 1)), round(t, 1)))
            rows[-1] += ("",) if args.baseline else ()
        del calls
    for layers in TOTALS:
        if not set(layers) <= set(ops):
            continue
        ms = {name: sum(totals[name][op] for op in layers) for name in backends}
        total_row = ("both maps", "+".join(layers), *(round(ms[name], 1) for name in backends))
        rows.append(total_row + ((f"{ms['baseline'] / ms['now']:.2f}x",) if args.baseline else ()))

    header = ("map", "op", *(f"{name} ms" for name in backends))
    if args.baseline:
        header += ("speedup",)
    print(f"numpy {np.__version__}, median of {args.repeats} interleaved calls, outputs allocated afresh")
    print(format_table(header, rows, title="numpy backend ops (lower is better)"))


if __name__ == "__main__":
    try:
        main()
    except UsageError as e:
        print(f"bench_numpy_ops: error: {e}", file=sys.stderr)
        sys.exit(2)
