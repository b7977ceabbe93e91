"""The device plumbing of the OpenCL backend: one device's context, queue, buffers and kernels.

It builds programs, launches kernels (an op's per-element kernel, or on CPUs its rows twin: ``flat``,
``planes``, ``channel_walk``), allocates and checks buffers, and runs the data-movement kernels several
ops share (row and channel sums, GEMM panel packing, transposes). Arrays are ``pyopencl.array.Array``
(float32, C-contiguous) from a memory pool; all work goes to one in-order queue, so kernels never wait
for each other on the host.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyopencl as cl
import pyopencl.array as cla
import pyopencl.tools as cl_tools

from backends.opencl.device import device_kind
from backends.opencl.gemm import Gemm
from backends.opencl.gemm_configs import DeviceLimits, cdiv, pocl_llvm_cpu

F32 = np.float32
i32 = np.int32
HERE = Path(__file__).resolve().parent
MAX_ELEMENTS = 2**31 - 1  # kernels index with 32-bit ints
OPS_SOURCES = ("layout.cl", "ops.cl", "wire.cl")  # one program: every kernel but the GEMM's


class ClRuntime:
    """One OpenCL device: context, in-order queue, buffer pool, built programs, and its GEMM (gemm.py)."""

    def __init__(
        self,
        device: cl.Device,
        autotune: bool,
        tune_file: Path,
        profile: bool = False,
        progress: Callable[[], None] | None = None,
    ) -> None:
        self.device = device
        self.progress = progress or (lambda: None)  # the backend's: called after each build and timed variant
        self.context = cl.Context([device])
        props = cl.command_queue_properties.PROFILING_ENABLE if profile else 0
        self.queue = cl.CommandQueue(self.context, properties=props)
        # with ``profile``: every kernel's event, by name, for kernel_times() (benchmarks only)
        self.events: list[tuple[str, cl.Event]] | None = [] if profile else None
        # Allocating a buffer is slow on some drivers; the pool reuses freed ones. Safe
        # with one in-order queue: a reused buffer's next writer queues after its last reader.
        self.pool = cl_tools.MemoryPool(cl_tools.ImmediateAllocator(self.queue))
        self.limits = DeviceLimits.of(device, device_kind(device))
        # PoCL's CPU devices call even sqrt out of line (ops.cl takes clang's builtin there)
        self.ops_options = "-DPOCL_CPU" if pocl_llvm_cpu(device.version) else ""
        self.wg = min(256, self.limits.max_work_group_size)  # 1-D launches: many items, any device
        # the rows kernels of ops.cl and layout.cl (a work-item walks a chunk, plane or row, which
        # PoCL turns into vector code) rather than the per-element ones (many small items, as GPUs
        # want): on CPU devices; tests and benchmarks set it to run either
        self.rows = self.limits.kind == "cpu"
        self.rl = 1 << (min(128, self.limits.max_work_group_size).bit_length() - 1)  # reduce_rows' group
        self._programs: dict[tuple[tuple[str, ...], str], cl.Program] = {}
        self._kernels: dict[str, tuple[cl.Kernel, int]] = {}
        # a launch sets a shared Kernel's arguments, then enqueues it: threads sharing this backend (in-process
        # workers) must not interleave the two, or a kernel runs with another launch's arguments
        self._launching = threading.Lock()
        self.gemm = Gemm(self, autotune, tune_file)

    # ---- programs and launches ---------------------------------------------------
    def program(self, filenames: str | tuple[str, ...], options: str = "") -> cl.Program:
        """The file(s) beside this module, concatenated, built once per context with ``options``.

        The build itself is cached on disk between runs: by pyopencl's binary cache on most
        platforms, and on PoCL (which pyopencl leaves to it) by PoCL's own kernel cache.
        """
        key = ((filenames,) if isinstance(filenames, str) else tuple(filenames), options)
        if key not in self._programs:
            source = "\n".join((HERE / name).read_text() for name in key[0])
            try:
                self._programs[key] = cl.Program(self.context, source).build(
                    options=["-cl-std=CL1.2", *options.split()]
                )
            except cl.RuntimeError as e:
                raise RuntimeError(
                    f"OpenCL could not compile {' + '.join(key[0])} ({options or 'no options'}) for "
                    f"{self.device.name.strip()}: {e}"
                ) from None
            self.progress()  # a build can take seconds: the compute goes on
        return self._programs[key]

    def kernel(self, name: str, defines: str = "") -> tuple[cl.Kernel, int]:
        """The kernel ``name`` of OPS_SOURCES (built with ``defines``) and the work-group size to launch it with."""
        key = f"{name} {defines}"
        if key not in self._kernels:
            knl = cl.Kernel(self.program(OPS_SOURCES, f"-DRL={self.rl} {self.ops_options} {defines}".strip()), name)
            limit = int(knl.get_work_group_info(cl.kernel_work_group_info.WORK_GROUP_SIZE, self.device))
            if name == "reduce_rows" and limit < self.rl:  # its group size is compiled in: rebuild smaller
                self.rl = 1 << (limit.bit_length() - 1)
                return self.kernel(name, defines)
            self._kernels[key] = (knl, min(self.wg, limit))
        return self._kernels[key]

    def launch(self, name: str, dims: int | tuple[int, ...], *args: Any, defines: str = "", rows: bool = False) -> None:
        """Run the kernel ``name`` of OPS_SOURCES over a 1-3 dimensional grid of ``dims`` work-items.

        Work-groups fill up to self.wg items, innermost dimension first; the grid is rounded
        up to whole groups and every kernel checks its bounds. ``defines`` selects a build of
        the kernels with a layer's window compiled in (see the header of ops.cl). ``rows``: a rows
        kernel, whose items each run a loop: about 16 groups per compute unit, so the cores share the
        work evenly, and no more (PoCL pays microseconds per group).
        """
        knl, wg = self.kernel(name, defines)
        dims = (dims,) if isinstance(dims, int) else dims
        if rows:
            wg = min(wg, 256, max(1, int(np.prod(dims)) // (16 * self.limits.compute_units)))
        if min(dims) <= 0:
            return
        local: list[int] = []
        for d in dims:
            room = wg // int(np.prod(local or [1]))
            local.append(min(1 << (d - 1).bit_length(), room))
        grid = tuple(cdiv(d, lo) * lo for d, lo in zip(dims, local, strict=True))
        self.ran(name, self.enqueue(knl, grid, tuple(local), *args))

    def enqueue(self, knl: cl.Kernel, grid: tuple[int, ...], local: tuple[int, ...] | None, *args: Any, **kw: Any):
        """``knl`` on the queue over ``grid``, its arguments set and its launch made under one lock."""
        with self._launching:
            return knl(self.queue, grid, local, *args, **kw)

    # ---- the ops' launches: per element, or their rows twins on CPUs (see ops.cl) ------------
    # An optimisation, the rows kernels: elements per work-item of the flat ones.
    CHUNK = 2048

    def flat(self, name: str, total: int, *args: Any) -> None:
        """Launch the elementwise kernel ``name`` over ``total`` elements: per element, or its rows
        twin, whose arguments are the same and then the chunk."""
        if self.rows:
            self.launch(f"{name}_rows", cdiv(total, self.CHUNK), *args, i32(self.CHUNK), rows=True)
        else:
            self.launch(name, total, *args)

    def planes(self, name: str, n: int, c: int, hw: int, *args: Any, defines: str = "") -> None:
        """Launch the per-pixel kernel ``name`` of an (n, c, h*w) map: global (hw, c, n), or its
        rows twin, one work-item per plane: global (c, n). The same arguments."""
        if self.rows:
            self.launch(f"{name}_rows", (c, n), *args, defines=defines, rows=True)
        else:
            self.launch(name, (hw, c, n), *args, defines=defines)

    # An optimisation, LRN's backward on CPUs: pixels per work-item walking the channels, at
    # most (a whole plane of conv1 or conv2: measured fastest, 256-1024 beside 32-128).
    LRN_BLOCK = 1024

    def channel_walk(self, name: str, n: int, c: int, hw: int, *args: Any, defines: str = "") -> None:
        """Launch the LRN backward kernel ``name``: per pixel, global (hw, c, n), or on CPUs its
        walk twin, one work-item per block of up to LRN_BLOCK pixels of an image walking the
        channels: global (blocks, n). The same arguments."""
        if self.rows:
            block = min(hw, self.LRN_BLOCK)  # the ring's width, compiled in
            walk_defines = f"{defines} -DLRN_BLOCK={block}"
            self.launch(f"{name}_walk", (cdiv(hw, block), n), *args, defines=walk_defines, rows=True)
        else:
            self.launch(name, (hw, c, n), *args, defines=defines)

    # ---- profiling (benchmarks/bench_opencl_profile.py) ----------------------------------
    def ran(self, name: str, event: cl.Event) -> None:
        """Keep a kernel's event when profiling; nothing otherwise."""
        if self.events is not None:
            self.events.append((name, event))

    def kernel_times(self) -> dict[str, tuple[int, float]]:
        """Per kernel name, (launches, seconds on the device) since the last call; needs ``profile``."""
        if self.events is None:
            raise RuntimeError("kernel_times() needs a ClRuntime made with profile=True")
        self.queue.finish()
        times: dict[str, tuple[int, float]] = {}
        for name, ev in self.events:
            calls, seconds = times.get(name, (0, 0.0))
            times[name] = (calls + 1, seconds + (ev.profile.end - ev.profile.start) * 1e-9)
        self.events.clear()
        return times

    # ---- buffers -------------------------------------------------------------------
    def empty(self, shape: tuple[int, ...], dtype: type = F32) -> cla.Array:
        """An uninitialised array from the pool; refused past the kernels' 32-bit indexing."""
        size = int(np.prod(shape))
        if size > MAX_ELEMENTS:
            raise ValueError(
                f"an array of {size} elements {shape} is past the kernels' 32-bit indexing; use a smaller batch"
            )
        return cla.empty(self.queue, shape, dtype, allocator=self.pool)

    def operand(self, a: Any, what: str, in_place: bool = False) -> cla.Array:
        """Check that ``a`` is a float32 array of this context; views are made contiguous."""
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

    # ---- data movement shared by several ops -----------------------------------------
    def reduce_rows(
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
        out = self.empty((rows,))
        if rows == 0:
            return out
        knl, _ = self.kernel("reduce_rows")
        s0, s1, s2 = strides
        inputs = (src.data, None if src2 is None else src2.data, None if center is None else center.data)
        walk = (i32(mode), i32(na), i32(nb), i32(s0), i32(s1), i32(s2))
        event = self.enqueue(knl, (rows * self.rl,), (self.rl,), *inputs, *walk, F32(divisor), out.data)
        self.ran("reduce_rows", event)
        return out

    def channel_sums(
        self,
        src: cla.Array,
        n: int,
        c: int,
        hw: int,
        mode: int = 0,
        src2: cla.Array | None = None,
        center: cla.Array | None = None,
        divisor: float = 1.0,
    ) -> cla.Array:
        """out[c] = sum over (n, q) of f(src[n, c, q]) / divisor (f by mode: see reduce_rows in ops.cl).

        On CPUs (an optimisation): each plane summed by one work-item (reduce_planes), then the
        n partials of each channel; otherwise one work-group per channel (reduce_rows)."""
        if not self.rows:
            return self.reduce_rows(src, c, n, hw, (hw, c * hw, 1), mode, src2, center, divisor)
        partial = self.empty((n * c,))
        inputs = (src.data, None if src2 is None else src2.data, None if center is None else center.data)
        self.launch("reduce_planes", (c, n), *inputs, i32(mode), i32(c), i32(hw), i32(n), partial.data, rows=True)
        return self.reduce_rows(partial, c, n, 1, (1, c, 0), divisor=divisor)

    def pack(self, src: cla.Array, k: int, n: int, sk: int, sn: int, nb: int) -> cla.Array:
        """B(k, n) = src[k*sk + n*sn] in the GEMM's panel layout of width nb."""
        out = self.empty((cdiv(n, nb) * k * nb,))
        self.launch("pack_panels", (nb, k, cdiv(n, nb)), src.data, i32(k), i32(n), i32(sk), i32(sn), i32(nb), out.data)
        return out

    def transpose(self, src: cla.Array, rows: int, cols: int) -> cla.Array:
        """A (rows, cols) row-major matrix -> its (cols, rows) transpose."""
        out = self.empty((cols * rows,))
        self.launch("transpose", (cols, rows), src.data, i32(rows), i32(cols), out.data)
        return out
