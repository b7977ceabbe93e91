#!/usr/bin/env python3
"""The GPU run: one command on a machine with an NVIDIA or AMD GPU and no internet.

    python benchmarks/gpu_run.py --wheels wheels/ --out gpu-run.json
    python benchmarks/gpu_run.py --dry-run --out dry-run.json   # any OpenCL device (PoCL), smallest sizes

Needs Python with numpy (torch too, for its column); pyopencl, pyzmq, msgpack, tqdm and pytest are
pip-installed from the local wheels of ``--wheels DIR`` (--no-index), only those missing. Then, in order:

1. driver: finds the vendor's OpenCL driver. An ICD file in /etc/OpenCL/vendors (or $OCL_ICD_VENDORS)
   names each installed runtime; where a vendor's library is on disk (libnvidia-opencl.so.1,
   libamdocl64.so, libigdrcl.so) but no ICD file names it, the script writes one into a temporary
   vendors folder, with copies of the ICD files already there, and points OCL_ICD_VENDORS at it, for
   itself and every process it starts. The device: ``--device``, else the first GPU
   ($TINYCONV_OPENCL_DEVICE, which the backend, the conformance suite and the worker honour, is set to it).
2. conformance: the conformance suite on that device (pytest tests/test_conformance.py -k opencl_conforms).
3. gemm: conv2 of the paper's networks (--gemm-archs) at --batch-size, forward and backward GFLOP/s on the
   OpenCL backend, beside torch on the same GPU (CUDA or ROCm): ``torch.matmul`` of the same GEMM
   shapes (cuBLAS / rocBLAS) and ``conv2d`` (cuDNN / MIOpen), in float32 with TF32 off.
4. step: a training step (forward, loss, backward, SGD) of paper_net(--arch) on the OpenCL backend,
   beside the numpy backend on the host (--host-threads BLAS threads).
5. split: the heterogeneous split: the master on the CPU (numpy) plus one GPU worker (OpenCL, a local
   ``tinyconv worker`` over ZeroMQ, or a thread with --transport inproc); the master alone's step and
   the split's, alternated, the speedup and each participant's kernels per layer.

Each part has a time budget (together under 8 minutes): the GEMM skips the shapes it has no time for,
the step and the split take fewer steps, and the split a smaller network when one of --arch's steps
would not fit. A part that cannot run says why in the JSON and the table. Prints one table and
writes --out. A script, not a test: it asserts nothing (tests/test_gpu_run.py checks the dry run's
JSON). docs/gpus.md says what each figure means.
"""

from __future__ import annotations

import argparse
import atexit
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from unittest.mock import patch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tinyconv.options import PAPER_ARCHS, Parser, UsageError, add, count  # noqa: E402
from tinyconv.options import arch as c1_c2  # noqa: E402

# import name -> distribution: what the run needs beyond numpy and torch
NEEDED = {"pyopencl": "pyopencl", "zmq": "pyzmq", "msgpack": "msgpack", "tqdm": "tqdm", "pytest": "pytest"}
VENDOR_LIBRARIES = {
    "nvidia": ("libnvidia-opencl.so.1",),
    "amd": ("libamdocl64.so", "libamdocl-orca64.so"),
    "intel": ("libigdrcl.so",),
}
LIBRARY_DIRS = (
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
    "/usr/local/lib",
    "/usr/local/nvidia/lib64",
    "/usr/local/nvidia/lib",
    "/opt/rocm/lib",
    "/opt/rocm/opencl/lib",
    "/usr/lib/wsl/lib",
)
INSTALL = (
    "install the vendor's driver with its OpenCL runtime: NVIDIA's driver (libnvidia-opencl.so.1; Debian/Ubuntu "
    "package libnvidia-compute-<version>), AMD ROCm (rocm-opencl-runtime: libamdocl64.so), Intel's compute-runtime "
    "(intel-opencl-icd). In a container, NVIDIA's libraries come with NVIDIA_DRIVER_CAPABILITIES=compute,utility"
)
BUDGETS = {"conformance": 90.0, "gemm": 120.0, "step": 60.0, "split": 150.0}  # seconds
TOTAL_S, MIN_BUDGET_S = 450.0, 5.0  # the parts end within 7.5 minutes of the start, whatever their budgets
DRY_RUN = {"gemm_archs": ["50:500"], "arch": "50:500", "batch_size": 8, "repeats": 1, "timed_steps": 2}
DRY_RUN["untimed_steps"] = 1


# ------------------------------------------------------------------ packages and driver (stdlib only)


def missing_packages() -> list[str]:
    """The distributions of NEEDED whose module this Python cannot import."""
    return [dist for module, dist in NEEDED.items() if importlib.util.find_spec(module) is None]


def install_wheels(wheels: Path | None) -> list[str]:
    """pip-install what is missing from the wheels in ``wheels``, offline; the distributions installed."""
    missing = missing_packages()
    if not missing:
        return []
    if wheels is None:
        sys.exit(
            f"gpu_run: missing {', '.join(missing)}. Give --wheels DIR, a folder of their wheels (and their "
            f"dependencies'), made where there is internet with: python -m pip download -d wheels {' '.join(missing)}"
        )
    pip = [sys.executable, "-m", "pip", "install", "--no-index", "--find-links", str(wheels), *missing]
    print("installing from local wheels:", " ".join(pip), flush=True)
    if subprocess.run(pip).returncode != 0:
        sys.exit(
            f"gpu_run: pip could not install {', '.join(missing)} from {wheels} (above: a wheel missing for this "
            "Python, or an externally managed Python: run in `python -m venv --system-site-packages .venv`)"
        )
    importlib.invalidate_caches()
    return missing


def icd_dirs() -> list[Path]:
    """Where the ICD loader looks for vendor files: $OCL_ICD_VENDORS, else /etc/OpenCL/vendors; and the
    vendors folder of this Python's prefix (pyopencl's bundled loader reads it too)."""
    env = os.environ.get("OCL_ICD_VENDORS")
    first = Path(env) if env else Path("/etc/OpenCL/vendors")
    return [d for d in dict.fromkeys((first, Path(sys.prefix) / "etc" / "OpenCL" / "vendors")) if d.exists()]


def icd_files(dirs: list[Path]) -> dict[str, str]:
    """{ICD file: the library it names} for every .icd file of ``dirs`` (a dir may be a single file)."""
    files = [p for d in dirs for p in ([d] if d.is_file() else sorted(d.glob("*.icd")))]
    return {str(f): f.read_text(errors="replace").strip() for f in files}


def vendor_libraries(dirs: list[str]) -> dict[str, str]:
    """{vendor: path} of the first OpenCL library of each GPU vendor found in ``dirs``."""
    found = {}
    for vendor, names in VENDOR_LIBRARIES.items():
        hits = [Path(d) / n for n in names for d in dirs if (Path(d) / n).exists()]
        if hits:
            found[vendor] = str(hits[0])
    return found


def library_dirs() -> list[str]:
    """$LD_LIBRARY_PATH's folders, the usual ones, and every installed ROCm's."""
    extra = [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d]
    rocm = [str(p) for p in sorted(Path("/opt").glob("rocm-*/lib"))]
    return list(dict.fromkeys([*extra, *LIBRARY_DIRS, *rocm]))


def find_driver(vendors_dir: Path | None = None) -> dict[str, Any]:
    """Find the installed ICD files and GPU vendors' libraries; where a library has no ICD file, write one
    into ``vendors_dir`` (default: a new temporary folder) beside copies of the ICD files found, and set
    OCL_ICD_VENDORS to that folder. Returns what was looked for and found, and what was written."""
    dirs, libs = icd_dirs(), vendor_libraries(library_dirs())
    icds = icd_files(dirs)
    named = {Path(lib).name for lib in icds.values()}
    unlisted = {v: p for v, p in libs.items() if Path(p).name not in named}
    written = {}
    if unlisted:
        out = vendors_dir or Path(tempfile.mkdtemp(prefix="tinyconv-icd-"))
        if vendors_dir is None:
            atexit.register(shutil.rmtree, out, True)
        for path in icds:  # the runtimes already installed stay visible beside the new one
            shutil.copy(path, out / Path(path).name)
        for vendor, lib in unlisted.items():
            (out / f"{vendor}-tinyconv.icd").write_text(lib + "\n")
            written[str(out / f"{vendor}-tinyconv.icd")] = lib
        os.environ["OCL_ICD_VENDORS"] = str(out)
    return {
        "icd_dirs": [str(d) for d in dirs],
        "icd_files": icds,
        "library_dirs": library_dirs(),
        "vendor_libraries": libs,
        "icd_written": written,
        "OCL_ICD_VENDORS": os.environ.get("OCL_ICD_VENDORS"),
    }


def set_host_threads(n: int) -> None:
    """BLAS threads of the numpy host (set before numpy is imported; the processes started inherit them)."""
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(n)


# ------------------------------------------------------------------ the device


def choose_device(spec: str | None, dry_run: bool, driver: dict[str, Any]) -> dict[str, Any]:
    """The OpenCL device to run on (``spec``, else $TINYCONV_OPENCL_DEVICE, else the first GPU; a dry run takes
    the first device when there is no GPU), as list_devices' dict; $TINYCONV_OPENCL_DEVICE set to its P:D."""
    from backends.opencl.device import ENV_DEVICE, NoOpenCLDevice, list_devices, select_device

    spec = spec or os.environ.get(ENV_DEVICE)
    try:
        devices = list_devices()
        if spec:  # P:D as it is; a kind or a name: the first device of that name, as select_device takes
            chosen = select_device(spec)
            same = [
                d for d in devices if (d["name"], d["platform"]) == (chosen.name.strip(), chosen.platform.name.strip())
            ]
            device = next((d for d in devices if d["spec"] == spec), same[0])
        else:
            gpus = [d for d in devices if d["kind"] == "gpu"]
            device = (gpus or (devices if dry_run else []) or [None])[0]
    except (NoOpenCLDevice, ValueError) as e:
        sys.exit(f"gpu_run: {e}\n{looked_for(driver)}")
    if device is None:
        seen = "; ".join(f"{d['spec']} {d['name']} ({d['kind']}, {d['platform']})" for d in devices)
        sys.exit(f"gpu_run: no OpenCL GPU found. Devices seen: {seen}.\n{looked_for(driver)}")
    os.environ[ENV_DEVICE] = device["spec"]
    return device


def looked_for(driver: dict[str, Any]) -> str:
    names = ", ".join(n for names in VENDOR_LIBRARIES.values() for n in names)
    return (
        f"Looked for ICD files in {driver['icd_dirs'] or '/etc/OpenCL/vendors (absent)'} (found "
        f"{list(driver['icd_files'].values()) or 'none'}) and for {names} in {', '.join(driver['library_dirs'])} "
        f"(found {list(driver['vendor_libraries'].values()) or 'none'}). To fix: {INSTALL}; or pass --device "
        "to run on another OpenCL device, or --dry-run to try the script on a CPU runtime (PoCL)."
    )


# ------------------------------------------------------------------ timing


def median_time(fn, sync, repeats: int, deadline: float) -> float:
    """The median of ``repeats`` timed runs of ``fn`` after one warm-up (compilation, autotuning); fewer
    runs (at least one) once ``deadline`` (time.monotonic) has passed."""
    import statistics

    fn()
    sync()
    times = []
    while len(times) < repeats and (not times or time.monotonic() < deadline):
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def skipped(reason: str) -> dict[str, Any]:
    return {"status": "skipped", "reason": reason}


# ------------------------------------------------------------------ 2. conformance


def run_conformance(budget: float) -> dict[str, Any]:
    """The conformance suite's OpenCL cases under pytest, on $TINYCONV_OPENCL_DEVICE."""
    command = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_conformance.py", "-k", "opencl_conforms"]
    t = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, *command], cwd=ROOT, capture_output=True, text=True, timeout=budget)
    except subprocess.TimeoutExpired:
        return skipped(f"the suite ran past its budget of {budget:.0f} s (--budget conformance=S)")
    lines = done.stdout.splitlines()
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", lines[-1] if lines else "")}
    if done.returncode not in (0, 1) or not counts:  # 0: all passed, 1: some failed; else pytest itself failed
        return {"status": "failed", "error": f"pytest exited {done.returncode}: {(done.stdout + done.stderr)[-1500:]}"}
    return {
        "status": "ran",
        "command": "python " + " ".join(command),
        "seconds": time.perf_counter() - t,
        "passed": counts.get("passed", 0),
        "failed": counts.get("failed", 0) + counts.get("error", 0),
        "skipped": counts.get("skipped", 0),
        "failures": [x for x in lines if x.startswith(("FAILED", "ERROR"))][:20],
    }


# ------------------------------------------------------------------ 3. gemm


def conv2_shape(arch: str, batch: int):
    """conv2 of paper_net(arch) at ``batch`` (tinyconv.distributed.conv_shapes' ConvShape)."""
    from tinyconv.distributed.conv_shapes import conv_shapes
    from tinyconv.model import paper_net

    return conv_shapes(paper_net(arch, "numpy"), batch)[1]


def gemm_flop(shape) -> tuple[float, float]:
    """The GEMM flop of a convolution forward (y = W cols) and backward (dW = dy cols^T, plus dcols = W^T dy)."""
    f, c, k, _ = shape.w
    n, _, oh, ow = shape.y
    flop = 2.0 * f * c * k * k * n * oh * ow
    return flop, flop * (2 if shape.need_dx else 1)


def time_tinyconv(be, shape, repeats: int, deadline: float) -> tuple[float, float]:
    """Seconds of one conv2d forward and one backward on backend ``be``."""
    import numpy as np

    rng = np.random.default_rng(0)
    x, w = rng.standard_normal(shape.x, np.float32), rng.standard_normal(shape.w, np.float32) * 0.05
    xd, wd, bd, dyd = (
        be.asarray(a) for a in (x, w, np.zeros(shape.w[0], np.float32), rng.standard_normal(shape.y, np.float32))
    )
    pad = shape.w[2] // 2
    _, cache = be.conv2d_forward(xd, wd, bd, 1, pad)
    fwd = median_time(lambda: be.conv2d_forward(xd, wd, bd, 1, pad), be.synchronize, repeats, deadline)
    bwd = median_time(lambda: be.conv2d_backward(dyd, cache, shape.need_dx), be.synchronize, repeats, deadline)
    return fwd, bwd


def torch_gpu(name: str) -> tuple[Any, str]:
    """(torch, what it runs on) where torch has a CUDA or ROCm GPU, else (None, why not). Torch's GPU: the one
    named ``name`` (the OpenCL device's name), else its first."""
    if importlib.util.find_spec("torch") is None:
        return None, "torch is not installed"
    import torch

    runtime = f"ROCm {torch.version.hip}" if torch.version.hip else f"CUDA {torch.version.cuda}"
    if not torch.cuda.is_available():
        build = runtime if torch.version.hip or torch.version.cuda else "CPU only"
        return None, f"torch {torch.__version__} ({build}) sees no GPU"
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    torch.cuda.set_device(names.index(name) if name in names else 0)
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 as tinyconv computes it, not TF32's 10-bit mantissas
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = True  # cuDNN picks its fastest algorithm, as the GEMM autotunes
    return (
        torch,
        f"torch {torch.__version__}, {runtime}, cuda:{torch.cuda.current_device()} {torch.cuda.get_device_name()}",
    )


def time_torch(torch, shape, repeats: int, deadline: float) -> dict[str, float]:
    """Seconds of the same GEMMs in torch.matmul and of the convolution in torch's conv2d, each way."""
    dev, sync = "cuda", torch.cuda.synchronize
    f, c, k, _ = shape.w
    n, _, oh, ow = shape.y
    w2, cols, dy2 = (torch.randn(s, device=dev) for s in ((f, c * k * k), (c * k * k, n * oh * ow), (f, n * oh * ow)))
    x = torch.randn(shape.x, device=dev, requires_grad=True)
    w = torch.randn(shape.w, device=dev, requires_grad=True)
    b = torch.zeros(f, device=dev, requires_grad=True)
    y = torch.nn.functional.conv2d(x, w, b, padding=k // 2)
    dy = torch.randn_like(y)

    def mm_bwd():
        return dy2 @ cols.T, w2.T @ dy2 if shape.need_dx else None

    def conv_fwd():
        return torch.nn.functional.conv2d(x, w, b, padding=k // 2)

    def conv_bwd():
        return torch.autograd.grad(y, (x, w, b), dy, retain_graph=True)

    fns = {"mm_fwd": lambda: w2 @ cols, "mm_bwd": mm_bwd, "conv_fwd": conv_fwd, "conv_bwd": conv_bwd}
    return {key: median_time(fn, sync, repeats, deadline) for key, fn in fns.items()}


def run_gemm(archs: list[str], batch: int, repeats: int, budget: float) -> dict[str, Any]:
    """conv2's GFLOP/s per architecture on the OpenCL backend and, where it can, torch on the same GPU. A shape
    is skipped when the last one's time, scaled by the flop, says it would not fit what is left of the budget."""
    from tqdm import tqdm

    from backends import get_backend

    be = get_backend("opencl")
    torch, torch_note = torch_gpu(be.describe()["device"])
    deadline, rows, per_flop = time.monotonic() + budget, [], 0.0
    for arch in tqdm(archs, desc="gemm: conv2 per network", disable=None):
        shape = conv2_shape(arch, batch)
        row, flop = {"arch": arch, "shape": f"conv2 x{shape.x} w{shape.w}"}, gemm_flop(shape)
        left = deadline - time.monotonic()
        if per_flop * sum(flop) > left:
            rows.append({**row, **skipped(f"would take ~{per_flop * sum(flop):.0f} s, {max(left, 0):.0f} s left")})
            continue
        t = time.monotonic()
        try:
            row.update(gemm_figures(be, torch, shape, repeats, deadline))
        except Exception as e:  # noqa: BLE001 -- e.g. out of device memory: the smaller shapes' figures stand
            row.update({"status": "failed", "error": f"{type(e).__name__}: {e}"})
        rows.append(row)
        per_flop = (time.monotonic() - t) / sum(flop)
    return {
        "status": "ran",
        "device": be.describe(),
        "torch": torch_note if torch else None,
        "torch_skipped": None if torch else torch_note,
        "batch": batch,
        "rows": rows,
    }


def gemm_figures(be, torch, shape, repeats: int, deadline: float) -> dict[str, Any]:
    """One shape's GFLOP/s: the OpenCL backend's convolution, and torch's GEMMs and convolution (with torch)."""
    fwd_flop, bwd_flop = gemm_flop(shape)
    fwd, bwd = time_tinyconv(be, shape, repeats, deadline)
    row = {
        "status": "ran",
        "fwd_gflop": fwd_flop / 1e9,
        "bwd_gflop": bwd_flop / 1e9,
        "opencl_fwd_gflops": fwd_flop / fwd / 1e9,
        "opencl_bwd_gflops": bwd_flop / bwd / 1e9,
    }
    if torch is not None:
        times = time_torch(torch, shape, repeats, deadline)
        row.update(
            {f"torch_{k}_gflops": (fwd_flop if k.endswith("fwd") else bwd_flop) / s / 1e9 for k, s in times.items()}
        )
    return row


# ------------------------------------------------------------------ 4. step


def step_times(be, arch: str, norm: str, batch: int, repeats: int, deadline: float) -> float:
    """The median seconds of a training step (forward, loss, backward, SGD) of paper_net(arch) on ``be``."""
    from tinyconv.lab.experiment.run import one_step, training_setup

    net, opt, x, y = training_setup(arch, norm, batch, be)
    return median_time(lambda: one_step(net, opt, x, y, None), be.synchronize, repeats, deadline)


def run_step(arch: str, norm: str, batch: int, repeats: int, budget: float, host_threads: int) -> dict[str, Any]:
    """The training step on the OpenCL device and on the numpy host, half the budget each."""
    from tqdm import tqdm

    from backends import get_backend

    times, start = {}, time.monotonic()
    for i, name in enumerate(tqdm(("opencl", "numpy"), desc=f"step: {arch} batch {batch}", disable=None)):
        times[name] = step_times(get_backend(name), arch, norm, batch, repeats, start + budget * (i + 1) / 2)
    return {
        "status": "ran",
        "arch": arch,
        "norm": norm,
        "batch": batch,
        "host_threads": host_threads,
        "opencl_step_s": times["opencl"],
        "numpy_step_s": times["numpy"],
        "opencl_speedup": times["numpy"] / times["opencl"],
    }


# ------------------------------------------------------------------ 5. split


def step_flop(arch: str, batch: int) -> float:
    """The GEMM flop of a training step's convolutions, forward and backward."""
    from tinyconv.distributed.conv_shapes import conv_shapes
    from tinyconv.model import paper_net

    return sum(sum(gemm_flop(s)) for s in conv_shapes(paper_net(arch, "numpy"), batch))


def fit_arch(arch: str, batch: int, numpy_step_s: float | None, steps_needed: int, budget: float) -> str:
    """``arch``, or the largest smaller paper network whose master-alone steps fit the budget, scaled from the
    numpy step measured at ``arch`` by the convolutions' flop (the smallest, when none does)."""
    from tinyconv.model import PAPER_ARCHS

    if numpy_step_s is None or numpy_step_s * steps_needed <= budget:
        return arch
    flop = step_flop(arch, batch)
    smaller = [a for a in reversed(PAPER_ARCHS) if step_flop(a, batch) < flop]
    fits = [a for a in smaller if numpy_step_s * step_flop(a, batch) / flop * steps_needed <= budget]
    return (fits or smaller or [arch])[0]


class MasterBesideWorker:
    """The master on every core but the local worker's (grid_workers pins it to the second one), then its
    cores back: the host's BLAS threads keep off the core that drives the GPU."""

    def __init__(self, transport: str) -> None:
        from tinyconv.lab.experiment.workers import cores

        self.before, self.pin = cores(), transport != "inproc" and hasattr(os, "sched_setaffinity")

    def __enter__(self) -> None:
        if self.pin and len(self.before) > 1:
            os.sched_setaffinity(0, set(self.before) - {self.before[1]})

    def __exit__(self, *exc: object) -> None:
        if self.pin:
            os.sched_setaffinity(0, self.before)


def split_steps(cluster, net, opt, x, y, steps: int, warmup: int, deadline: float) -> tuple[list, list]:
    """``warmup`` distributed steps (the rebalancer settles), then master-alone and distributed steps
    alternated (one settling step after each switch), up to ``steps`` pairs, at least one, until ``deadline``."""
    from tqdm import tqdm

    from tinyconv.lab.experiment.run import alternate, one_step

    for _ in tqdm(range(warmup), desc="split: warm-up", disable=None):
        if time.monotonic() > deadline:
            break
        one_step(net, opt, x, y, cluster)
    solo, dist = [], []
    with tqdm(total=steps, desc="split: alone / with the GPU", disable=None) as bar:
        while len(dist) < steps and (not dist or time.monotonic() < deadline):
            s, d = alternate(net, opt, x, y, cluster, 1, 1)
            solo, dist = solo + s, dist + d
            bar.update()
    return solo, dist


def run_split(args: argparse.Namespace, budget: float, numpy_step_s: float | None) -> dict[str, Any]:
    """The master (numpy, on the host) with one GPU worker (OpenCL), against the master alone."""
    from backends import get_backend
    from tinyconv.distributed.heap import keep_freed_memory
    from tinyconv.distributed.rebalance import Rebalancer
    from tinyconv.distributed.shard.cluster import Cluster
    from tinyconv.lab.experiment.run import REBALANCE_THRESHOLD, RECV_TIMEOUT_S, med, shares_text, training_setup
    from tinyconv.lab.experiment.workers import grid_workers

    deadline = time.monotonic() + budget
    arch = fit_arch(args.arch, args.batch_size, numpy_step_s, 4 * args.timed_steps + args.untimed_steps + 6, budget)
    keep_freed_memory()  # as the main job's master does (tinyconv/distributed/heap.py)
    be = get_backend("numpy")
    net, opt, x, y = training_setup(arch, args.norm, args.batch_size, be)
    # The worker keeps its GPU's default GEMM variant: autotuning times every variant of a shape the first time
    # it sees one, and each new share is a new shape, mid-step, which the master takes for a lost worker
    # (no result within 2 x its expected compute + 1 s).
    with (
        patch.dict(os.environ, {"TINYCONV_OPENCL_AUTOTUNE": "0"}),
        grid_workers(1, args.transport, "opencl", timeout=120) as (transport, workers),
        MasterBesideWorker(args.transport),
    ):
        cluster = Cluster(
            transport,
            workers,
            be,
            master_share="auto",
            recv_timeout=RECV_TIMEOUT_S,
            rebalancer=Rebalancer(threshold=REBALANCE_THRESHOLD),
        )
        try:
            calibrated = cluster.calibrate(net, args.batch_size)
            solo, dist = split_steps(cluster, net, opt, x, y, args.timed_steps, args.untimed_steps, deadline)
            participants, events = cluster.participants, cluster.pop_events()
        finally:
            cluster.close()
    solo_s, dist_s = med(solo, "time_s"), med(dist, "time_s")
    return {
        "status": "ran",
        "arch": arch,
        "arch_asked": args.arch,
        "norm": args.norm,
        "batch": args.batch_size,
        "transport": args.transport,
        "worker": {"backend": workers[0].backend, **workers[0].device},
        "worker_autotune": False,
        "participants": participants,
        "steps": len(dist),
        "calibrated_shares": shares_text(calibrated["shares"]),
        "shares": shares_text(dist[-1]["shares"]),
        "channel_shares": shares_text(dist[-1].get("channel_shares", {})),
        "alone_step_s": solo_s,
        "split_step_s": dist_s,
        "speedup": solo_s / dist_s,
        "comm_s": med(dist, "comm_s"),
        "conv_s": med(dist, "conv_s"),
        "comp_s": med(dist, "comp_s"),
        "workers_lost": sum(e["event"] == "worker_lost" for e in events),
        "events": events,
    }


# ------------------------------------------------------------------ the table, the command


def table_rows(parts: dict[str, dict[str, Any]], device: dict[str, Any], driver: dict[str, Any]) -> list[tuple]:
    """(part, figure, value, beside it, note) for the summary table."""
    icd = f"ICD written: {', '.join(driver['icd_written'])}" if driver["icd_written"] else "ICD files as installed"
    rows = [("device", f"{device['spec']} {device['name']}", device["kind"], device["platform"], icd)]
    for name, part in parts.items():
        if part["status"] != "ran":
            rows.append((name, part["status"], "-", "-", part.get("reason") or part.get("error", "")))
        elif name == "conformance":
            rows.append(
                (
                    name,
                    "cases passed",
                    f"{part['passed']}/{part['passed'] + part['failed']}",
                    "-",
                    f"{part['failed']} failed, {part['skipped']} skipped, {part['seconds']:.0f} s",
                )
            )
        elif name == "gemm":
            rows += gemm_rows(part)
        elif name == "step":
            rows.append(
                (
                    name,
                    f"{part['arch']} {part['norm']} batch {part['batch']}, s",
                    part["opencl_step_s"],
                    f"numpy {part['numpy_step_s']:.3g} s, BLAS threads {part['host_threads']}",
                    f"OpenCL {part['opencl_speedup']:.2f}x numpy",
                )
            )
        elif name == "split":
            rows.append(
                (
                    name,
                    f"{part['arch']} batch {part['batch']}, step s",
                    part["split_step_s"],
                    f"master alone {part['alone_step_s']:.3g} s",
                    f"speedup {part['speedup']:.2f}x, "
                    f"kernels {'/'.join(part['participants'])} {part['shares']}"
                    + (f", worker lost {part['workers_lost']}x" if part["workers_lost"] else ""),
                )
            )
    return rows


def gemm_rows(part: dict[str, Any]) -> list[tuple]:
    rows = []
    for r in part["rows"]:
        if r["status"] != "ran":
            rows.append(("gemm", f"conv2 {r['arch']} {r['status']}", "-", "-", r.get("reason") or r["error"]))
            continue
        for way in ("fwd", "bwd"):
            torch = (
                f"torch mm {r[f'torch_mm_{way}_gflops']:.0f}, conv2d {r[f'torch_conv_{way}_gflops']:.0f}"
                if part["torch"]
                else "-"
            )
            note = f"{r[f'{way}_gflop']:.1f} GFLOP" + ("" if part["torch"] else f"; no torch: {part['torch_skipped']}")
            rows.append(("gemm", f"conv2 {r['arch']} {way} GFLOP/s", r[f"opencl_{way}_gflops"], torch, note))
    return rows


def budgets(pairs: list[str]) -> dict[str, float]:
    """BUDGETS with --budget PART=SECONDS applied."""
    out = dict(BUDGETS)
    for pair in pairs:
        part, _, seconds = pair.partition("=")
        if part not in out or not re.fullmatch(r"\d+(\.\d+)?", seconds):
            raise UsageError(f"--budget {pair!r}: give PART=SECONDS, PART one of {', '.join(out)}")
        out[part] = float(seconds)
    return out


NORMAL = {"gemm_archs": [*PAPER_ARCHS], "arch": "300:1000", "batch_size": 64, "repeats": 5, "timed_steps": 5}
NORMAL["untimed_steps"] = 8


def build_parser() -> Parser:
    doc = __doc__.split("\n\n", 1)
    p = Parser(description=doc[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=doc[1])
    add(p, "out", defaults={"out": "gpu-run.json"}, helps={"out": "the JSON file"})
    needed = ", ".join(NEEDED.values())
    wheels = f"a folder of wheels: what is missing of {needed} is pip-installed from it, offline"
    p.add_argument("--wheels", type=Path, metavar="DIR", help=wheels)
    add(p, "device", helps={"device": "or a kind (gpu, cpu)"})
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="a quick check of the script itself: conv2 of 50:500 only, batch size 8, one repeat, 2 split steps, "
        "on any OpenCL device (PoCL), without autotuning; the options given still apply",
    )
    p.add_argument(
        "--gemm-archs",
        type=c1_c2,
        nargs="+",
        metavar="C1:C2",
        help="the networks whose conv2 the GEMM part times (default: the paper's four)",
    )
    add(
        p,
        "arch",
        "norm",
        "batch_size",
        "repeats",
        "timed_steps",
        "untimed_steps",
        "transport",
        defaults={"norm": "lrn", "transport": "zmq"},
        helps={
            "arch": "the step's and the split's (default 300:1000)",
            "batch_size": "default 64",
            "repeats": "of each GEMM and step figure (default 5)",
            "timed_steps": "here the master alone's and the split's steps, alternated (default 5)",
            "untimed_steps": "here split steps first, for the rebalancer (default 8)",
            "transport": "here the GPU worker's: zmq, a local process, or inproc, a thread of this one",
        },
    )
    p.add_argument(
        "--host-threads",
        type=count(1),
        default=max(1, (os.cpu_count() or 2) - 1),
        metavar="N",
        help="BLAS threads of the numpy host (default: all cores but one: it drives the GPU)",
    )
    defaults = ", ".join(f"{k} {v:.0f}" for k, v in BUDGETS.items())
    seconds = f"seconds a part may take, e.g. gemm=200 ({defaults}; all at most {TOTAL_S:.0f})"
    p.add_argument("--budget", action="append", default=[], metavar="PART=S", help=seconds)
    p.add_argument("--skip", action="append", default=[], choices=tuple(BUDGETS), help="leave a part out")
    return p


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The options, with the dry run's or the normal run's sizes where none was given; UsageError for a bad one."""
    p = build_parser()
    args = p.parse_args(argv)
    for key, value in (DRY_RUN if args.dry_run else NORMAL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.transport not in ("zmq", "inproc"):
        p.error(f"--transport {args.transport}: the GPU worker goes over zmq or inproc")
    args.out, args.budgets = Path(args.out), budgets(args.budget)
    return args


def run_parts(args: argparse.Namespace, deadline: float) -> dict[str, dict[str, Any]]:
    """Each part in turn, in its budget and before ``deadline`` (time.monotonic); one that raises is recorded as
    failed, and the rest still run."""
    archs = args.gemm_archs
    parts: dict[str, dict[str, Any]] = {}
    calls = {
        "conformance": lambda b: run_conformance(b),
        "gemm": lambda b: run_gemm(archs, args.batch_size, args.repeats, b),
        "step": lambda b: run_step(args.arch, args.norm, args.batch_size, args.repeats, b, args.host_threads),
        "split": lambda b: run_split(args, b, parts.get("step", {}).get("numpy_step_s")),
    }
    for name, call in calls.items():
        if name in args.skip:
            parts[name] = skipped("--skip")
            continue
        budget = min(args.budgets[name], deadline - time.monotonic())
        if budget < MIN_BUDGET_S:
            parts[name] = skipped(f"the run's {TOTAL_S / 60:.1f} minutes were spent")
            continue
        print(f"{name} (up to {budget:.0f} s) ...", flush=True)
        try:
            parts[name] = call(budget)
        except Exception as e:  # noqa: BLE001 -- one part's failure is a result, and the next part still runs
            parts[name] = {"status": "failed", "error": f"{type(e).__name__}: {e}"}
    return parts


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse(argv)
    except UsageError as e:
        print(f"gpu_run: error: {e}", file=sys.stderr)
        return 2
    start = time.monotonic()
    set_host_threads(args.host_threads)  # before numpy is imported
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))  # workers
    installed = install_wheels(args.wheels)
    driver = find_driver()  # before pyopencl is imported: the ICD loader reads OCL_ICD_VENDORS once
    device = choose_device(args.device, args.dry_run, driver)
    if args.dry_run:
        os.environ.setdefault("TINYCONV_OPENCL_AUTOTUNE", "0")  # each GEMM on its device's default variant
    parts = run_parts(args, start + TOTAL_S)
    from tinyconv.report import format_table

    title = f"GPU run{' (dry run)' if args.dry_run else ''}: {device['name']}, {time.monotonic() - start:.0f} s"
    print(format_table(("part", "figure", "value", "beside it", "note"), table_rows(parts, device, driver), title))
    result = {
        "dry_run": args.dry_run,
        "options": {k: v for k, v in vars(args).items() if k != "budgets"},
        "seconds": time.monotonic() - start,
        "installed": installed,
        "driver": driver,
        "device": device,
        "host": {
            "python": platform.python_version(),
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "host_threads": args.host_threads,
        },
        "budgets": args.budgets,
        "parts": parts,
    }
    args.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"wrote {args.out}")
    return 1 if any(p["status"] == "failed" or p.get("failed") for p in parts.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
