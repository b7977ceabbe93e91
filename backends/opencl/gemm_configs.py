"""The GEMM's kernel configurations (the variants of gemm.cl: ``VecConfig`` for CPUs, ``TiledConfig`` for
GPUs, docs/gpus.md says why) and which of them fit a device: ``candidates(limits)``, the default first.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import pyopencl as cl


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# LLVM's names of the x86 CPUs with AVX-512. PoCL's binary builds compile for the nearest CPU
# they know, which may lack what the host has (Zen 4 is compiled for as Zen 3), yet report the
# host's 16-wide floats: its float16 kernels then fail to build -- a program without the kernel
# (INVALID_KERNEL_NAME), and an abort at exit ("still have references to IRs").
AVX512_LLVM_CPUS = frozenset(
    "skylake-avx512 cascadelake cooperlake cannonlake icelake-client icelake-server tigerlake rocketlake "
    "sapphirerapids emeraldrapids graniterapids graniterapids-d diamondrapids znver4 znver5 x86-64-v4 knl knm".split()
)


def pocl_llvm_cpu(version: str) -> str | None:
    """The CPU PoCL compiles for, from its device version ("... HSTR: pthread-x86_64-...-znver3"); else None."""
    m = re.search(r"HSTR: \w+-x86_64-[^-\s]+-[^-\s]+-[^-\s]+-(\S+)", version)
    return m.group(1) if m else None


@dataclass(frozen=True)
class DeviceLimits:
    """What the kernel configurations must fit, read once from the device."""

    key: str  # platform | device | driver (| PoCL's CPU): tuned choices are only reused on the same one
    kind: str  # "cpu", "gpu", ...
    compute_units: int
    max_work_group_size: int
    local_mem_bytes: int
    vector_width: int  # preferred float vector width, clamped to 4..16

    @classmethod
    def of(cls, device: cl.Device, kind: str) -> DeviceLimits:
        vw = int(device.preferred_vector_width_float or 1)
        vw = min(16, max(4, 1 << (vw.bit_length() - 1)))  # a power of two; 1 (GPUs) -> 4
        cpu = pocl_llvm_cpu(device.version)  # in the key too: PoCL names a device by its CPU's brand alone
        if vw == 16 and cpu is not None and cpu not in AVX512_LLVM_CPUS:
            vw = 8  # PoCL reads 16 from the host, but compiles for a CPU without AVX-512 (see AVX512_LLVM_CPUS)
        key = f"{device.platform.name.strip()} | {device.name.strip()} | {device.driver_version.strip()}"
        return cls(
            key=key + (f" | {cpu}" if cpu else ""),
            kind=kind,
            compute_units=int(device.max_compute_units),
            max_work_group_size=int(device.max_work_group_size),
            local_mem_bytes=int(device.local_mem_size),
            vector_width=vw,
        )


@dataclass(frozen=True)
class VecConfig:
    """gemm_vec: a work-item computes rm rows x (vw*rn) columns; ``local`` work-items per group."""

    rm: int
    vw: int
    rn: int
    local: int = 1
    kind = "vec"

    @property
    def nb(self) -> int:
        return self.vw * self.rn

    def options(self) -> str:
        return f"-DRM={self.rm} -DVW={self.vw} -DRN={self.rn}"

    def tiles(self, m: int, n: int) -> int:
        return cdiv(m, self.rm) * cdiv(n, self.nb)

    def grid(self, m: int, n: int, splits: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        rows = cdiv(cdiv(m, self.rm), self.local) * self.local
        return (rows, cdiv(n, self.nb), splits), (self.local, 1, 1)

    def fits(self, d: DeviceLimits) -> bool:
        return self.local <= d.max_work_group_size


@dataclass(frozen=True)
class TiledConfig:
    """gemm_tiled: a (tx, ty) work-group computes a (ty*wm) x (tx*wn) tile, tsk deep per step."""

    tx: int
    ty: int
    wm: int
    wn: int
    tsk: int
    kind = "tiled"

    @property
    def nb(self) -> int:
        return self.tx * self.wn

    def options(self) -> str:
        return f"-DTX={self.tx} -DTY={self.ty} -DWM={self.wm} -DWN={self.wn} -DTSK={self.tsk}"

    def tiles(self, m: int, n: int) -> int:
        return cdiv(m, self.ty * self.wm) * cdiv(n, self.nb)

    def grid(self, m: int, n: int, splits: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        groups = (cdiv(n, self.nb), cdiv(m, self.ty * self.wm), splits)
        return (self.tx * groups[0], self.ty * groups[1], splits), (self.tx, self.ty, 1)

    def local_bytes(self) -> int:
        return 4 * self.tsk * (self.ty * self.wm + 1 + self.nb)

    def fits(self, d: DeviceLimits) -> bool:
        return self.tx * self.ty <= d.max_work_group_size and self.local_bytes() <= d.local_mem_bytes


Config = VecConfig | TiledConfig


def config_from_json(d: dict[str, Any]) -> Config | None:
    """The config a tune file names, or None if the entry is not one (an old or edited file)."""
    try:
        fields = {k: int(v) for k, v in d.items() if k not in ("kind", "ms")}
        return {"vec": VecConfig, "tiled": TiledConfig}[d["kind"]](**fields)
    except (KeyError, TypeError, ValueError):
        return None


# Register blocks (rm, rn) worth trying: rm*rn accumulators, rn vectors of B and one of A must
# fit the vector registers. 16-wide floats mean AVX-512 and its 32 registers (12x2 keeps 24
# accumulators); narrower ones AVX2 or SSE and 16 (4x3: 12 + 3 + 1 -- measured on an 8-wide AVX2
# target: 4x3 213, 6x2 207, 4x2 197, 8x2 122, 6x3 81 GFLOP/s, where 8x2 and 6x3 spill).
VEC_BLOCKS_32_REGISTERS = ((8, 2), (12, 2), (6, 3), (4, 2), (6, 2), (4, 3))
VEC_BLOCKS_16_REGISTERS = ((4, 3), (6, 2), (4, 2), (8, 1))
# (tx, ty, wm, wn, tsk): from a 256-item 64x64 tile down to one any device can run.
TILED = ((16, 16, 4, 4, 16), (16, 8, 4, 4, 16), (8, 8, 4, 4, 16), (16, 16, 2, 2, 16), (4, 4, 2, 2, 8))


def candidates(d: DeviceLimits, vector_width: int | None = None) -> list[Config]:
    """Every configuration worth timing on this device (with float vectors of ``vector_width``,
    default the device's preferred one), the default first."""
    local = 1 if d.kind == "cpu" else min(64, d.max_work_group_size)
    vw = vector_width or d.vector_width
    blocks = VEC_BLOCKS_32_REGISTERS if vw >= 16 else VEC_BLOCKS_16_REGISTERS
    vec: list[Config] = [VecConfig(rm, vw, rn, local) for rm, rn in blocks]
    if d.kind == "cpu":  # gemm_tiled is ~60x slower on a CPU runtime (docs/gpus.md)
        return [c for c in vec if c.fits(d)]
    tiled: list[Config] = [TiledConfig(*t) for t in TILED]
    return [c for c in tiled + vec[:1] if c.fits(d)]
