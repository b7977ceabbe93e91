"""The one GEMM every convolution and linear layer of the OpenCL backend runs on.

    C (M x N) = A (M x K) @ B (K x N) [+ bias per row]

A and C are strided views of existing buffers (``AView``, ``CView``); B comes packed in column
panels of width NB by a callback, because the best NB depends on the kernel variant (see the
header of gemm.cl for the index maps). How a variant is chosen and kept between runs, in one small
JSON file per user: docs/gpus.md. That file holds
{"<device> | <driver> | gemm.cl <digest>": {"<call site> M.. N.. K.. KI..": {config..., "ms": ..}}}.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import platformdirs  # a dependency of pyopencl
import pyopencl as cl
import pyopencl.array as cla

from backends.opencl.gemm_configs import Config, candidates, cdiv, config_from_json

log = logging.getLogger(__name__)
i32 = np.int32

TUNE_MIN_FLOP = 1e8  # below this a GEMM takes milliseconds: not worth timing variants
ENV_AUTOTUNE = "TINYCONV_OPENCL_AUTOTUNE"  # "0" turns autotuning off
ENV_TUNE_FILE = "TINYCONV_OPENCL_TUNE_FILE"  # where the tuned choices are kept


def default_tune_file() -> Path:
    """$TINYCONV_OPENCL_TUNE_FILE, else tinyconv/opencl-gemm.json in the user cache directory."""
    if os.environ.get(ENV_TUNE_FILE):
        return Path(os.environ[ENV_TUNE_FILE])
    return Path(platformdirs.user_cache_dir("tinyconv", False)) / "opencl-gemm.json"


def source_digest() -> str:
    """A short digest of gemm.cl, the kernels the tuned choices were timed with."""
    return hashlib.sha256((Path(__file__).parent / "gemm.cl").read_bytes()).hexdigest()[:12]


def read_tune_file(path: Path) -> dict[str, Any]:
    """The whole file, or {} if it is missing, unreadable or not a JSON object."""
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def load_entry(path: Path, device_key: str, shape_key: str) -> dict[str, Any] | None:
    """The entry kept for one shape on one device, if any."""
    device = read_tune_file(path).get(device_key)
    entry = device.get(shape_key) if isinstance(device, dict) else None
    return entry if isinstance(entry, dict) else None


def save_entry(path: Path, device_key: str, shape_key: str, entry: dict[str, Any]) -> None:
    """Merge one entry into the file (re-read first: other processes share it)."""
    data = read_tune_file(path)
    device = data.get(device_key)
    if not isinstance(device, dict):
        device = data[device_key] = {}
    device[shape_key] = entry
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)  # atomic: a reader never sees half a file
    except OSError as e:  # a read-only home is no reason to fail a training run
        log.warning("could not save GEMM tuning to %s: %s", path, e)


@dataclass(frozen=True)
class AView:
    """A(m, k) = buf[m*sm + (k // ki)*skb + (k % ki)*sk]: a strided matrix whose k axis may be
    two axes of the buffer (ki = K when it is not)."""

    buf: cl.Buffer
    sm: int
    sk: int
    ki: int
    skb: int = 0


@dataclass(frozen=True)
class CView:
    """C(m, n) -> buf[m*sm + (n // ni)*snb + (n % ni)*sn]."""

    buf: cl.Buffer
    sm: int
    sn: int
    ni: int
    snb: int = 0

    @staticmethod
    def rows(buf: cl.Buffer, n: int) -> CView:
        """A plain row-major (M, n) matrix."""
        return CView(buf, n, 1, n, 0)


class Gemm:
    """Runs C = A @ B (+ bias) on the device of ``rt``, the ClRuntime that owns it (its programs, queue,
    buffers and profile), choosing and remembering the variant."""

    def __init__(self, rt: Any, autotune: bool, tune_file: Path) -> None:
        self.rt, self.queue, self.limits = rt, rt.queue, rt.limits
        self.autotune, self.tune_file = autotune, tune_file
        self.tag = ""  # the call site of the GEMM running now, for that profile
        self.chosen: dict[str, Config] = {}  # shape key -> config, this process
        self.tune_key = f"{self.limits.key} | gemm.cl {source_digest()}"
        self._kernels: dict[tuple[str, str], cl.Kernel] = {}
        # the device's preferred vector width first, narrower ones only if none of those builds
        tried: list[Config] = []
        self.candidates: list[Config] = []
        vw = self.limits.vector_width
        while not self.candidates and vw >= 4:
            fitting = candidates(self.limits, vw)
            self.candidates = [cfg for cfg in fitting if self._builds(cfg)]
            tried += fitting
            vw //= 2
        if not self.candidates:
            raise RuntimeError(
                f"no GEMM configuration builds on this device ({self.limits.key}); tried "
                f"{', '.join(cfg.options() for cfg in tried) or 'none: none fits its limits'}"
            )

    def _builds(self, cfg: Config) -> bool:
        """Whether the device's compiler builds ``cfg``'s kernel. Not every one does: a runtime may
        return a program without the kernel (INVALID_KERNEL_NAME), as PoCL does for float16 on a
        host it compiles for without AVX-512 (see AVX512_LLVM_CPUS)."""
        try:
            self.kernel(cfg.options(), f"gemm_{cfg.kind}")
        except (cl.Error, RuntimeError) as e:
            log.warning("GEMM %s does not build on this device, skipped: %s", cfg.options(), e)
            return False
        return True

    # ---- running ------------------------------------------------------------------
    def __call__(
        self,
        tag: str,
        m: int,
        n: int,
        k: int,
        a: AView,
        pack_b: Callable[[int], cla.Array],
        c: CView,
        bias: cla.Array | None = None,
    ) -> None:
        """C = A @ B (+ bias[m]). ``pack_b(nb)`` returns B in panels of width nb. ``tag`` names the
        call site (the layout of A and C) for the tune file."""

        def run(cfg: Config) -> None:
            self.run(cfg, m, n, k, a, pack_b(cfg.nb), c, bias)

        cfg = self.config(f"{tag} M{m} N{n} K{k} KI{min(a.ki, k)}", 2.0 * m * n * k, run)
        self.tag = tag
        run(cfg)

    def kernel(self, options: str, name: str) -> cl.Kernel:
        key = (options, name)
        if key not in self._kernels:
            self._kernels[key] = cl.Kernel(self.rt.program("gemm.cl", options), name)
        return self._kernels[key]

    def splits(self, cfg: Config, m: int, n: int, k: int) -> int:
        """How many slices of the k axis to sum separately: enough work-groups to fill the device,
        and (gemm_vec) a B chunk of at most 256 KiB so it stays in a CPU's L2 while rows of A stream."""
        want = cdiv(4 * self.limits.compute_units, cfg.tiles(m, n))
        if cfg.kind == "vec":
            want = max(want, cdiv(k, (256 * 1024) // (4 * cfg.nb)))
        return max(1, min(want, k // 256, 64))

    def run(
        self, cfg: Config, m: int, n: int, k: int, a: AView, b: cla.Array, c: CView, bias: cla.Array | None
    ) -> None:
        """One GEMM with a given configuration (B already packed with width cfg.nb)."""
        s = self.splits(cfg, m, n, k)
        kc = cdiv(k, s)
        s = cdiv(k, kc)
        knl = self.kernel(cfg.options(), f"gemm_{cfg.kind}")
        gsize, lsize = cfg.grid(m, n, s)
        sizes = (i32(m), i32(n), i32(k), i32(kc))
        a_args = (a.buf, i32(a.sm), i32(a.sk), i32(a.ki), i32(a.skb))
        c_args = (c.buf, i32(c.sm), i32(c.sn), i32(c.ni), i32(c.snb))
        bias_args = (None if bias is None else bias.data, i32(bias is not None))
        partial = self.rt.empty((s * m * n,)) if s > 1 else None  # (s, m, n) row-major, summed into C below
        out = (partial.data, i32(n), i32(1), i32(n), i32(0), None, i32(0)) if s > 1 else (*c_args, *bias_args)
        self.rt.ran(f"gemm {self.tag}", self.rt.enqueue(knl, gsize, lsize, *sizes, *a_args, b.data, *out))
        if s == 1:
            return
        wg = min(64, self.limits.max_work_group_size)
        total = self.kernel("", "gemm_sum_splits")
        event = self.rt.enqueue(
            total, (cdiv(n, wg) * wg, m), (wg, 1), i32(m), i32(n), i32(s), partial.data, *c_args, *bias_args
        )
        self.rt.ran(f"gemm {self.tag} split-K sum", event)

    # ---- choosing -----------------------------------------------------------------
    def config(self, key: str, flop: float, run: Callable[[Config], None]) -> Config:
        """The variant for the GEMM ``key`` (call site and shape): chosen once per process, timed
        with ``run`` when it is worth it, or remembered from the tune file."""
        if key in self.chosen:
            return self.chosen[key]
        cfg = self.candidates[0]
        if self.autotune and flop >= TUNE_MIN_FLOP and len(self.candidates) > 1:
            saved = config_from_json(load_entry(self.tune_file, self.tune_key, key) or {})
            cfg = saved if saved in self.candidates else self._tune(key, run)  # a choice it can still run
        self.chosen[key] = cfg
        return cfg

    def _tune(self, key: str, run: Callable[[Config], None]) -> Config:
        """Time every candidate (packing included: it depends on NB) and keep the fastest.

        Each candidate runs once to compile (PoCL builds work-group code on first launch), then
        the candidates take turns, best of several rounds, so a burst of load from another
        process does not decide the choice.
        """

        def once(cfg: Config) -> float:
            t0 = time.perf_counter()
            run(cfg)
            self.queue.finish()
            self.rt.progress()  # tuning takes many runs of the GEMM: the compute goes on
            return time.perf_counter() - t0

        warm = max(once(cfg) for cfg in self.candidates)
        rounds = 2 if warm > 0.05 else 5
        times = {cfg: once(cfg) for cfg in self.candidates}
        for _ in range(rounds - 1):  # interleaved rounds: every candidate sees the same load
            times = {cfg: min(t, once(cfg)) for cfg, t in times.items()}
        best = min(times, key=times.__getitem__)
        log.info(
            "gemm %s: %s (%s)", key, best, ", ".join(f"{cf.options()} {t * 1e3:.1f} ms" for cf, t in times.items())
        )
        entry = {"kind": best.kind, **asdict(best), "ms": round(times[best] * 1e3, 3)}
        save_entry(self.tune_file, self.tune_key, key, entry)
        return best
