"""The OpenCL backend, op by op against the numpy reference, plus its GEMM variants, tuning and
device choice, and a few training steps of a small paper_net giving numpy's losses.

Skipped as a whole (with the reason) only when the machine has no OpenCL device.

Tolerances: backends.conformance.runner's float32_tolerance (its docstring has the math), which holds for
any summation order -- tiles, split-K, vector widths, fused multiply-adds. The convolution, the
linear layer and the GEMM variants are checked entry by entry against 2 gamma_k * sum|terms|, the
terms' absolute values summed in float64 and k the reduction's length; normalisations, the loss
and the small network's training steps in its scale form, 2 gamma_k * max|ref| with k counted
along the path (the table in docs/writing-a-backend.md). Data movement and elementwise ops
that do the same float32 operations as numpy (relu, the max of maxpool, sgd, asarray/take_kernels)
must match exactly (k = 0).
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

cl = pytest.importorskip("pyopencl")
cla = pytest.importorskip("pyopencl.array")

from float32_expected import Expected, assert_close, conv2d_expected, linear_expected  # noqa: E402

from backends import get_backend  # noqa: E402
from backends.conformance.runner import FN  # noqa: E402
from backends.numpy_backend import NumpyBackend  # noqa: E402
from backends.opencl import NoOpenCLDevice, OpenCLBackend, device, gemm_configs, list_devices, select_device  # noqa: E402
from backends.opencl import gemm as gemm_module  # noqa: E402
from backends.opencl.gemm import AView, CView  # noqa: E402
from backends.opencl.gemm_configs import TiledConfig, VecConfig, candidates, cdiv  # noqa: E402
from backends.opencl.maxpool import lanes_fit, plane_defines  # noqa: E402

REF = NumpyBackend()
F32 = np.float32


@pytest.fixture(scope="module")
def be(tmp_path_factory) -> OpenCLBackend:
    """One backend for the whole file (kernels compile once); no autotuning, no user cache writes."""
    try:
        return OpenCLBackend(autotune=False, tune_file=tmp_path_factory.mktemp("tune") / "gemm.json")
    except NoOpenCLDevice as e:
        pytest.skip(f"no OpenCL device on this machine: {e}")


def normal(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(F32)


def check(be: OpenCLBackend, got, ref: Expected, what: str = "") -> None:
    """got (a device array) is within ref's float32_tolerance of its value, with its shape and dtype."""
    assert isinstance(got, cla.Array), f"{what}: returned {type(got).__name__}, not a device array"
    assert_close(be.to_numpy(got), ref, what)


def gemm_expected(a: np.ndarray, b: np.ndarray, bias: np.ndarray | None = None) -> Expected:
    """a @ b (+ bias per row) in float32 with its rigorous bound: k = K (+ 1), terms |a| @ |b| (+ |bias|)."""
    value, terms, k = a @ b, np.abs(a).astype(np.float64) @ np.abs(b), a.shape[1]
    if bias is not None:
        value, terms, k = value + bias[:, None], terms + np.abs(bias)[:, None], k + 1
    return Expected(value.astype(F32), k, terms)


# ------------------------------------------------------------------ convolution


@pytest.mark.parametrize(
    "n, c, h, w, f, k, stride, pad, need_dx",
    [
        (1, 3, 7, 9, 5, 3, 1, 0, True),  # batch 1, odd sizes, no padding
        (2, 4, 8, 8, 6, 5, 1, 2, True),  # the paper's 5x5 "same" convolution
        (3, 2, 9, 7, 4, 3, 2, 1, True),  # stride 2
        (2, 3, 11, 10, 3, 5, 2, 2, True),  # stride 2, pad 2, odd output
        (2, 5, 6, 6, 4, 1, 1, 0, True),  # 1x1
        (1, 1, 5, 5, 1, 5, 2, 0, True),  # one output pixel
        (2, 3, 7, 7, 33, 3, 1, 1, False),  # the first layer: no dx; F not a multiple of any block
        (3, 7, 13, 11, 17, 5, 1, 2, True),  # columns (3*13*11) cross panel and image edges
    ],
)
def test_conv2d_matches_numpy(be, rng, n, c, h, w, f, k, stride, pad, need_dx):
    x, wt, b = normal(rng, n, c, h, w), normal(rng, f, c, k, k, scale=0.3), normal(rng, f)
    (y_ref,) = conv2d_expected(x, wt, b, stride, pad)
    xd, wd, bd = be.asarray(x), be.asarray(wt), be.asarray(b)
    y, cache = be.conv2d_forward(xd, wd, bd, stride, pad)
    check(be, y, y_ref, what="y")
    dy = normal(rng, *y_ref.value.shape)
    _, dx_ref, dw_ref, db_ref = conv2d_expected(x, wt, b, stride, pad, dy, need_dx)
    dx, dw, db = be.conv2d_backward(be.asarray(dy), cache, need_dx)
    check(be, dw, dw_ref, what="dw")
    check(be, db, db_ref, what="db")
    if need_dx:
        check(be, dx, dx_ref, what="dx")
    else:
        assert dx is None
    for dev, host in ((xd, x), (wd, wt), (bd, b)):  # inputs are not modified
        assert np.array_equal(be.to_numpy(dev), host)


def test_conv2d_with_a_kernel_slice(be, rng):
    """The sharded convolution runs the master's share with take_kernels' rows as weights."""
    x, wt, b = normal(rng, 2, 3, 6, 6), normal(rng, 7, 3, 3, 3), normal(rng, 7)
    wd, bd = be.asarray(wt), be.asarray(b)
    w_part, b_part = be.take_kernels(wd, 2, 5), be.take_kernels(bd, 2, 5)
    assert np.array_equal(be.to_numpy(w_part), wt[2:5]) and np.array_equal(be.to_numpy(b_part), b[2:5])
    y, _ = be.conv2d_forward(be.asarray(x), w_part, b_part, 1, 1)
    check(be, y, conv2d_expected(x, wt[2:5], b[2:5], 1, 1)[0])
    y, _ = be.conv2d_forward(be.asarray(x), wd[2:5], bd[2:5], 1, 1)  # a raw view at an offset works too
    check(be, y, conv2d_expected(x, wt[2:5], b[2:5], 1, 1)[0])


# ------------------------------------------------------------------ the GEMM and its variants


def every_config(be: OpenCLBackend) -> list:
    """The device's candidates (those its compiler builds) plus the GPU-style tiled kernel, which a
    CPU never tunes to but a GPU will run: it must be right here too."""
    extra = [TiledConfig(4, 4, 2, 2, 8), TiledConfig(8, 8, 4, 4, 16), VecConfig(3, 4, 1, 2)]
    return list(dict.fromkeys(be.rt.gemm.candidates + [c for c in extra if c.fits(be.rt.limits)]))


@pytest.mark.parametrize("m, n, k", [(7, 13, 5), (33, 70, 51), (50, 75, 300), (13, 100, 1), (1, 1, 700)])
def test_every_gemm_variant_with_and_without_splits(be, rng, monkeypatch, m, n, k):
    """C = A B + bias for every variant and both split-K paths, with A read through a split k axis
    (as dW reads dY in NCHW) and C written both row-major and image by image (as the conv output)."""
    a, b, bias = normal(rng, m, k), normal(rng, k, n), normal(rng, m)
    ref = gemm_expected(a, b, bias)
    ki = k // 3 if k % 3 == 0 else k  # A stored as (k // ki, m, ki): a two-level k walk when k allows
    a_buf = be.asarray(np.ascontiguousarray(a.reshape(m, k // ki, ki).transpose(1, 0, 2)))
    a_view = AView(a_buf.data, ki, 1, ki, m * ki)
    ni = 6  # C as (groups, m, ni) "images" of ni columns: C(m, n) -> [(n // ni)*m*ni + m*ni + n % ni]
    groups = cdiv(n, ni)
    bias_d = be.asarray(bias)
    for cfg in every_config(be):
        b_d = be.rt.pack(be.asarray(b), k, n, n, 1, cfg.nb)
        for splits in (1, min(4, k)):
            with monkeypatch.context() as mp:
                mp.setattr(be.rt.gemm, "splits", lambda *_, s=splits: s)
                rows = be.zeros((m, n))
                be.rt.gemm.run(cfg, m, n, k, a_view, b_d, CView.rows(rows.data, n), bias_d)
                check(be, rows, ref, what=f"{cfg} splits={splits} row-major")
                images = be.zeros((groups * m * ni,))
                be.rt.gemm.run(cfg, m, n, k, a_view, b_d, CView(images.data, ni, 1, ni, m * ni), bias_d)
            got = be.to_numpy(images).reshape(groups, m, ni).transpose(1, 0, 2).reshape(m, groups * ni)[:, :n]
            check(be, be.asarray(np.ascontiguousarray(got)), ref, what=f"{cfg} splits={splits} by image")


def test_gemm_autotune_saves_and_reuses_its_choice(be, rng, tmp_path, monkeypatch):
    monkeypatch.setattr(gemm_module, "TUNE_MIN_FLOP", 0)  # tune even this small shape
    tune_file, rt = tmp_path / "tune.json", be.rt
    tuner = gemm_module.Gemm(rt, True, tune_file)
    m, n, k = 20, 70, 40
    a, b = normal(rng, m, k), normal(rng, k, n)
    a_d, b_d, c_d = be.asarray(a), be.asarray(b), be.zeros((m, n))

    def pack(nb):
        return be.rt.pack(b_d, k, n, n, 1, nb)

    notes = []  # each variant timed says the compute goes on (a worker's master keeps its deadline open)
    monkeypatch.setattr(rt, "progress", lambda: notes.append(1))
    tuner("test", m, n, k, AView(a_d.data, k, 1, k), pack, CView.rows(c_d.data, n))
    check(be, c_d, gemm_expected(a, b))
    assert len(notes) >= 2 * len(tuner.candidates)  # a warm-up run of each, then the rounds
    saved = json.loads(tune_file.read_text())
    assert tuner.tune_key.startswith(be.rt.limits.key) and "gemm.cl " in tuner.tune_key
    entry = saved[tuner.tune_key][f"test M{m} N{n} K{k} KI{k}"]
    assert gemm_configs.config_from_json(entry) in tuner.candidates and entry["ms"] > 0

    again = gemm_module.Gemm(rt, True, tune_file)
    monkeypatch.setattr(again, "_tune", lambda *a: pytest.fail("a saved choice must not be re-timed"))
    assert (
        again.config(f"test M{m} N{n} K{k} KI{k}", 2.0 * m * n * k, None) == tuner.chosen[f"test M{m} N{n} K{k} KI{k}"]
    )

    tune_file.write_text("{not json")  # a damaged file is ignored (and rewritten), not fatal
    third = gemm_module.Gemm(rt, True, tune_file)
    third("test", m, n, k, AView(a_d.data, k, 1, k), pack, CView.rows(c_d.data, n))
    check(be, c_d, gemm_expected(a, b))
    assert json.loads(tune_file.read_text())[third.tune_key]

    # another gemm.cl (or driver): the choice is timed again, not taken from the old entry
    monkeypatch.setattr(gemm_module, "source_digest", lambda: "edited")
    fourth = gemm_module.Gemm(rt, True, tune_file)
    timed = []
    monkeypatch.setattr(fourth, "_tune", lambda key, *a: timed.append(key) or fourth.candidates[0])
    fourth.config(f"test M{m} N{n} K{k} KI{k}", 2.0 * m * n * k, None)
    assert timed == [f"test M{m} N{n} K{k} KI{k}"]


def test_the_kernels_need_no_double_precision_and_no_images():
    # many GPUs (most mobile ones, some integrated ones) have neither; an unsuffixed literal such as
    # 0.5 is a double in OpenCL C and needs cl_khr_fp64 on a conforming compiler
    literal = re.compile(r"(?<![\w.])(\d+\.\d*|\.\d+)([eE][-+]?\d+)?(?![\w.])")
    sources = sorted((Path(gemm_module.__file__).parent).glob("*.cl"))
    assert {p.name for p in sources} >= {"gemm.cl", "ops.cl", "layout.cl"}
    for path in sources:
        code = "\n".join(line.split("//")[0] for line in path.read_text().splitlines())
        assert not re.search(r"\b(double\d*|image[123]d\w*_t|sampler_t|half\d*)\b|cl_khr_fp64", code), path.name
        assert not literal.search(code), f"{path.name}: {literal.search(code).group(0)} needs an f suffix"
    assert literal.search("x * 0.5 + y") and not literal.search("x * 0.5f + y")  # the check itself


def test_gemm_candidates_respect_the_device_limits(be):
    small = gemm_configs.DeviceLimits("k", "gpu", 8, max_work_group_size=64, local_mem_bytes=4096, vector_width=4)
    cands = candidates(small)
    assert cands and all(c.fits(small) for c in cands)
    assert all(c.tx * c.ty <= 64 and c.local_bytes() <= 4096 for c in cands if isinstance(c, TiledConfig))
    cpu = gemm_configs.DeviceLimits("k", "cpu", 2, 4096, 1 << 20, 16)
    assert all(isinstance(c, VecConfig) and c.vw == 16 for c in candidates(cpu))
    assert all(c.vw == 8 for c in candidates(cpu, 8))


def test_pocl_compiling_for_a_cpu_without_avx512_gets_8_wide_vectors():
    def device(version: str, width: int = 16) -> SimpleNamespace:
        platform = SimpleNamespace(name="Portable Computing Language")
        return SimpleNamespace(
            preferred_vector_width_float=width,
            version=version,
            platform=platform,
            name="cpu",
            driver_version="3.0",
            max_compute_units=2,
            max_work_group_size=4096,
            local_mem_size=1 << 20,
        )

    hstr = "OpenCL 3.0 PoCL HSTR: pthread-x86_64-unknown-linux-gnu-"
    assert gemm_configs.pocl_llvm_cpu(hstr + "skylake-avx512") == "skylake-avx512"
    assert gemm_configs.pocl_llvm_cpu("OpenCL 3.0 CUDA") is None
    widths = {cpu: gemm_configs.DeviceLimits.of(device(hstr + cpu), "cpu").vector_width for cpu in ("znver3", "znver4")}
    assert widths == {"znver3": 8, "znver4": 16}  # Zen 4 hosts are compiled for as Zen 3 by PoCL 3.0's wheels
    assert gemm_configs.DeviceLimits.of(device("OpenCL 3.0 other"), "cpu").vector_width == 16  # not PoCL: trusted
    assert gemm_configs.DeviceLimits.of(device(hstr + "znver3", 4), "cpu").vector_width == 4
    # the tune file's key: one CPU brand compiled for two CPUs keeps two sets of choices
    keys = {gemm_configs.DeviceLimits.of(device(hstr + cpu), "cpu").key for cpu in ("haswell", "skylake-avx512")}
    assert keys == {
        "Portable Computing Language | cpu | 3.0 | haswell",
        "Portable Computing Language | cpu | 3.0 | skylake-avx512",
    }
    assert (
        gemm_configs.DeviceLimits.of(device("OpenCL 3.0 CUDA"), "gpu").key == "Portable Computing Language | cpu | 3.0"
    )


def test_gemm_falls_back_to_narrower_vectors_when_the_preferred_ones_do_not_build(be, monkeypatch, tmp_path):
    # as PoCL 3.0 on an AMD Zen 4 does: it reports 16-wide floats and builds no float16 kernel
    rt = be.rt
    wide = dataclasses.replace(rt.limits, vector_width=16, kind="cpu")  # a CPU's candidates, on any device
    monkeypatch.setattr(rt, "limits", wide)

    def gemm(builds):
        monkeypatch.setattr(gemm_module.Gemm, "_builds", lambda self, cfg: builds(cfg))
        return gemm_module.Gemm(rt, False, tmp_path / "gemm.json")

    assert {c.vw for c in gemm(lambda cfg: cfg.vw < 16).candidates} == {8}
    assert {c.vw for c in gemm(lambda cfg: True).candidates} == {16}
    with pytest.raises(RuntimeError, match=r"no GEMM configuration builds on this device .* -DVW=4"):
        gemm(lambda cfg: False)


# ------------------------------------------------------------------ elementwise, norms, pooling


def test_relu_is_exact(be, rng):
    x, dy = normal(rng, 2, 3, 5, 7), normal(rng, 2, 3, 5, 7)
    y, cache = be.relu_forward(be.asarray(x))
    y_ref, cache_ref = REF.relu_forward(x)
    check(be, y, Expected(y_ref, 0))
    check(be, be.relu_backward(be.asarray(dy), cache), Expected(REF.relu_backward(dy, cache_ref), 0))


@pytest.mark.parametrize("size", [3, 4, 5])
@pytest.mark.parametrize("alpha, beta, k, scale", [(1e-4, 0.75, 2.0, 1.0), (2e-2, 0.6, 1.0, 5.0)])
def test_lrn_matches_numpy(be, rng, size, alpha, beta, k, scale):
    """Large alpha makes the cross-channel term of the gradient matter; even sizes have an
    asymmetric window; 3 channels is fewer than the window of 4 and 5."""
    for shape in ((2, 7, 3, 5), (1, 3, 4, 4)):
        x, dy = normal(rng, *shape, scale=scale), normal(rng, *shape)
        y_ref, cache_ref = REF.lrn_forward(x, size, alpha, beta, k)
        y, cache = be.lrn_forward(be.asarray(x), size, alpha, beta, k)
        check(be, y, Expected(y_ref, size + 3 + FN), what="y")  # the ks of lrn (backends.conformance.runner)
        dx_ref = Expected(REF.lrn_backward(dy, cache_ref), 2 * size + 7 + 2 * FN)
        check(be, be.lrn_backward(be.asarray(dy), cache), dx_ref, what="dx")


@pytest.mark.parametrize("size", [3, 4, 5])
@pytest.mark.parametrize("alpha, beta, scale", [(1e-4, 0.75, 1.0), (2e-2, 0.6, 5.0)])
def test_fused_relu_lrn_matches_numpys_composition(be, rng, size, alpha, beta, scale):
    """The fused kernels against relu then lrn on numpy, with exact zeros (where the ReLU's mask is 0)."""
    for shape in ((2, 7, 3, 5), (1, 3, 4, 4)):
        x, dy = normal(rng, *shape, scale=scale), normal(rng, *shape)
        x[rng.random(shape) < 0.2] = 0.0
        r_ref, relu_ref = REF.relu_forward(x)
        y_ref, lrn_ref = REF.lrn_forward(r_ref, size, alpha, beta, 2.0)
        y, cache = be.relu_lrn_forward(be.asarray(x), size, alpha, beta, 2.0)
        check(be, y, Expected(y_ref, size + 3 + FN), what="y")  # the ReLU is exact: LRN's ks
        dx_ref = Expected(REF.relu_backward(REF.lrn_backward(dy, lrn_ref), relu_ref), 2 * size + 7 + 2 * FN)
        check(be, be.relu_lrn_backward(be.asarray(dy), cache), dx_ref, what="dx")


def test_lrn_defaults_are_numpys(be, rng):
    """torch.nn.LocalResponseNorm's: size 5, alpha 1e-4, beta 0.75, k 1."""
    x = normal(rng, 2, 7, 3, 5, scale=30.0)  # large enough that k = 1 vs 2 shows
    check(be, be.lrn_forward(be.asarray(x))[0], Expected(REF.lrn_forward(x, 5, 1e-4, 0.75, 1.0)[0], 5 + 3 + FN))


# (2, 3, 7, 5): planes of 35, two 16-lane blocks and a tail
@pytest.mark.parametrize(
    "shape, momentum", [((2, 4, 5, 5), 0.1), ((1, 3, 4, 3), 0.2), ((4, 6, 1, 1), 0.1), ((2, 3, 7, 5), 0.1)]
)
@pytest.mark.parametrize("rows", [False, True])
def test_batchnorm_train_then_eval_with_running_stats(be, rng, monkeypatch, shape, momentum, rows):
    """Both variants (per-element kernels and one work-group per channel; rows kernels and
    per-plane partial sums) against numpy, within the round-off of any summation order."""
    monkeypatch.setattr(be, "rows", rows)
    c = shape[1]
    gamma, beta = normal(rng, c), normal(rng, c)
    rm, rv = normal(rng, c), (rng.random(c) + 0.5).astype(F32)
    rm_d, rv_d = be.asarray(rm), be.asarray(rv)
    g_d, b_d = be.asarray(gamma), be.asarray(beta)
    # float32_tolerance's scale form, the longest path here: two updates of the running variance
    # (batchnorm's k for y, backends.conformance.runner), then eval's dgamma, a sum of N*H*W through them
    m = shape[0] * shape[2] * shape[3]
    k = 2 * (2 * m + 8 + 2 * FN) + m + 3 + 2 * FN
    for training in (True, True, False):  # two updates of the running stats, then use them
        x, dy = normal(rng, *shape, scale=2.0) + F32(0.5), normal(rng, *shape)
        y_ref, cache_ref = REF.batchnorm_forward(x, gamma, beta, rm, rv, training, momentum, 1e-5)
        y, cache = be.batchnorm_forward(be.asarray(x), g_d, b_d, rm_d, rv_d, training, momentum, 1e-5)
        check(be, y, Expected(y_ref, k), what="y")
        check(be, rm_d, Expected(rm, k), what="running_mean")
        check(be, rv_d, Expected(rv, k), what="running_var")
        dx_ref, dgamma_ref, dbeta_ref = REF.batchnorm_backward(dy, cache_ref)
        dx, dgamma, dbeta = be.batchnorm_backward(be.asarray(dy), cache)
        check(be, dx, Expected(dx_ref, k), what="dx")
        check(be, dgamma, Expected(dgamma_ref, k), what="dgamma")
        check(be, dbeta, Expected(dbeta_ref, k), what="dbeta")


@pytest.mark.parametrize(
    "shape, kernel, stride, pad",
    [((2, 3, 9, 7), 2, 2, 0), ((2, 3, 9, 7), 3, 2, 1), ((1, 2, 8, 8), 3, 1, 1), ((1, 1, 16, 16), 3, 2, 1)],
)
@pytest.mark.parametrize("ties", [False, True])
def test_maxpool_matches_numpy_including_ties(be, rng, shape, kernel, stride, pad, ties):
    """With few distinct values many windows hold several maxima: the gradient must go to the
    first in row-major order (numpy's choice), and overlapping windows must sum."""
    x = rng.integers(0, 3, size=shape).astype(F32) if ties else normal(rng, *shape)
    y_ref, cache_ref = REF.maxpool_forward(x, kernel, stride, pad)
    y, cache = be.maxpool_forward(be.asarray(x), kernel, stride, pad)
    check(be, y, Expected(y_ref, 0), what="y")
    dy = normal(rng, *y_ref.shape)
    # k: the windows that overlap; terms: the same routing of |dy| in float64
    overlaps = ((kernel + stride - 1) // stride) ** 2
    terms = REF.maxpool_backward(np.abs(dy).astype(np.float64), cache_ref)
    dx_ref = Expected(REF.maxpool_backward(dy, cache_ref), overlaps, terms)
    check(be, be.maxpool_backward(be.asarray(dy), cache), dx_ref, what="dx")


@pytest.mark.parametrize(
    "shape, kernel, stride, pad",
    [((2, 3, 9, 7), 2, 2, 0), ((2, 3, 9, 7), 3, 2, 1), ((1, 2, 8, 8), 3, 1, 1), ((1, 1, 16, 16), 3, 2, 1)],
)
def test_maxpool_propagates_nan_as_numpy_and_torch_do(be, rng, shape, kernel, stride, pad):
    """A window holding a NaN outputs NaN and its gradient goes to its last NaN in row-major order;
    window (1, 1) of the first plane holds two (its first and last corner), others share one."""
    x = normal(rng, *shape)
    x[rng.random(shape) < 0.1] = np.nan
    top = stride - pad
    first, last = (0, 0, top, top), (0, 0, top + kernel - 1, top + kernel - 1)
    x[first] = x[last] = np.nan
    y_ref, cache_ref = REF.maxpool_forward(x, kernel, stride, pad)
    y, cache = be.maxpool_forward(be.asarray(x), kernel, stride, pad)
    got = be.to_numpy(y)
    assert np.isnan(y_ref).any() and not np.isnan(y_ref).all()
    assert np.array_equal(np.isnan(got), np.isnan(y_ref)) and np.array_equal(got, y_ref, equal_nan=True)
    dy = normal(rng, *y_ref.shape)
    # k: the windows that overlap; terms: the same routing of |dy| in float64
    overlaps = ((kernel + stride - 1) // stride) ** 2
    terms = REF.maxpool_backward(np.abs(dy).astype(np.float64), cache_ref)
    dx_ref = Expected(REF.maxpool_backward(dy, cache_ref), overlaps, terms)
    check(be, be.maxpool_backward(be.asarray(dy), cache), dx_ref, what="dx")
    one = np.zeros(y_ref.shape, F32)
    one[0, 0, 1, 1] = 1.0  # that window's gradient alone
    dx = be.to_numpy(be.maxpool_backward(be.asarray(one), cache))
    assert dx[last] == 1.0 and dx.sum() == 1.0


@pytest.mark.parametrize(
    "shape, kernel, stride, pad",
    [
        ((1, 1, 7, 9), 3, 2, 1),  # one plane: the simple forward kernel alone
        ((1, 2, 9, 7), 2, 2, 0),  # two planes: still the simple kernel
        ((1, 3, 7, 9), 3, 2, 1),  # three: first and last plane simple, the middle one the fast kernel
        ((2, 3, 8, 8), 3, 1, 1),  # kernel != stride, three windows overlap per axis
        ((3, 1, 5, 6), 2, 1, 1),
        ((1, 3, 12, 13), 4, 3, 2),
        ((3, 2, 6, 9), 1, 2, 0),  # stride > kernel: columns no window holds get zero
        ((1, 2, 5, 3), 3, 2, 1),  # rows shorter than a vector, every window at an edge
        ((2, 1, 9, 40), 3, 2, 1),  # a row of 20 windows: a vectorised walk between the edges
        # output rows of whole vectors (maxpool.lanes_fit): the lanes kernel, its vectors at the
        # buffer's ends loaded lane by lane
        ((2, 3, 16, 16), 3, 2, 1),  # pool2 of the paper's net: a vector a row
        ((1, 3, 6, 32), 3, 2, 1),  # pool1's rows: two vectors a row
        ((1, 2, 7, 16), 3, 2, 1),  # odd rows: the last input row in one window row
        ((2, 2, 7, 33), 3, 2, 0),  # odd rows, no padding
        ((1, 3, 5, 17), 2, 1, 0),  # stride 1
    ],
)
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("rows", [False, True])
def test_maxpool_kernel_variants_agree_exactly_with_numpy(be, rng, monkeypatch, shape, kernel, stride, pad, ties, rows):
    """Every forward variant (per element: the simple kernel at the first and last plane, the fast
    one between; rows: one work-item per output row; planes: one per plane or two, the plane's size
    compiled in, and where output rows are whole vectors its lanes twin) and every backward kernel
    (per-element gather, per-row walk, per-plane scatter, and for the network's pool on whole
    vectors the planes' vector gather, which the backend picks there) on odd sizes, padding, ties and NaN in
    edge windows: y exactly numpy's; with small-integer dy every sum is exact in any
    order, so dx is exactly numpy's (routing and overlap sums); with normal dy the two backward
    kernels add the same terms in the same order, bit for bit."""
    x = rng.integers(0, 3, size=shape).astype(F32) if ties else normal(rng, *shape)
    x[:, :, 0, 0] = np.nan  # the corner window (padding around it, when pad > 0) in every plane
    x[-1, -1, -1, -2:] = np.nan  # the last plane's last row: two NaNs in its edge windows
    x[0, shape[1] // 2, shape[2] // 2, -1] = np.nan  # the right edge of a middle plane
    x[-1, 0, -1, shape[3] // 2] = np.nan  # inside a row, away from its edges
    monkeypatch.setattr(be, "rows", rows)
    y_ref, cache_ref = REF.maxpool_forward(x, kernel, stride, pad)
    y, cache = be.maxpool_forward(be.asarray(x), kernel, stride, pad)
    got = be.to_numpy(y)
    assert np.array_equal(got.view(np.int32), y_ref.view(np.int32))  # NaN payloads too

    x_shape, arg, geometry, window, lanes_back = cache
    n, c, h, w = x_shape
    # the forward kernels launched by name, all three on every shape: the per-element one, the rows
    # one (an output row per item) and the planes one, with 1 and 2 planes per item (a partial last)
    oh, ow = y_ref.shape[2:]
    kernels = [("maxpool_forward", (ow, oh, n * c), window), ("maxpool_forward_rows", (oh, n * c), window)]
    kernels += [("maxpool_forward_planes", cdiv(n * c, g), plane_defines(window, h, w, g)) for g in (1, 2)]
    if lanes_fit(stride, ow):  # and the planes' lanes kernel, 8 windows a vector
        kernels += [("maxpool_forward_lanes", cdiv(n * c, g), plane_defines(window, h, w, g)) for g in (1, 2)]
    for name, dims, defines in kernels:
        ky, ka = be.rt.empty(y_ref.shape), be.rt.empty(y_ref.shape, np.int32)
        be.rt.launch(name, dims, be.asarray(x).data, *geometry, ky.data, ka.data, defines=defines)
        assert np.array_equal(be.to_numpy(ky).view(np.int32), y_ref.view(np.int32)), name
        assert np.array_equal(ka.get(), arg.get()), name
    plain = rng.integers(-8, 9, size=y_ref.shape).astype(F32)  # sums of <= 9 of them: exact
    noisy = normal(rng, *y_ref.shape)
    plain[..., 0, 0] = noisy[..., 0, 0] = -0.0  # -0 summed from 0.0f gives +0 in every kernel alike
    for dy, exact in ((plain, REF.maxpool_backward(plain, cache_ref)), (noisy, None)):
        dx = {}
        backward = [
            ("maxpool_backward", (w, h, n * c), window),
            ("maxpool_backward_rows", n * c * h, window),
            ("maxpool_backward_planes", n * c, plane_defines(window, h, w, 1)),
            ("maxpool_backward_planes 2", cdiv(n * c, 2), plane_defines(window, h, w, 2)),
        ]
        assert lanes_back == ((kernel, stride, pad) == (3, 2, 1) and ow % 8 == 0 and w == 2 * ow)
        if lanes_back:  # the network's pool on whole vectors: the planes' gather, 8 windows a vector
            lanes = [(f"maxpool_backward_lanes {g}", cdiv(n * c, g), plane_defines(window, h, w, g)) for g in (1, 2)]
            backward += lanes
        for name, dims, defines in backward:
            out = be.rt.empty(x_shape)
            be.rt.launch(name.split()[0], dims, be.asarray(dy).data, arg.data, *geometry, out.data, defines=defines)
            dx[name] = be.to_numpy(out)
        simple, rows = dx["maxpool_backward"], dx["maxpool_backward_rows"]
        for name, got in dx.items():
            assert np.array_equal(got.view(np.int32), simple.view(np.int32)), name
        if exact is not None:
            assert np.array_equal(simple, exact)
    assert np.array_equal(be.to_numpy(be.maxpool_backward(be.asarray(dy), cache)).view(np.int32), rows.view(np.int32))


# The rows kernels (ops.cl: one work-item walks a chunk, a plane or an output row; what CPUs
# run) do the per-element kernels' float operations in the same order: the same bits, NaN
# payloads included. Odd shapes: 1-3 planes, odd H*W, planes shorter than a vector.
ROW_SHAPES = [(1, 1, 1, 3), (1, 2, 3, 5), (2, 3, 5, 7), (1, 7, 1, 17)]


def both_variants(be, monkeypatch, op):
    """op() (device arrays) with the per-element kernels, then with the rows kernels: as numpy, bit-identical."""
    out = {}
    for rows in (False, True):
        monkeypatch.setattr(be, "rows", rows)
        out[rows] = [be.to_numpy(a) for a in op()]
    for simple, walked in zip(out[False], out[True], strict=True):
        assert simple.shape == walked.shape and np.array_equal(simple.view(np.int32), walked.view(np.int32))
    return out[True]


def with_nans(rng, shape):
    x = normal(rng, *shape, scale=2.0)
    x[rng.random(shape) < 0.1] = np.nan
    x.flat[0] = -0.0
    return x


@pytest.mark.parametrize("shape", ROW_SHAPES)
def test_relu_and_sgd_rows_kernels_give_the_same_bits(be, rng, monkeypatch, shape):
    monkeypatch.setattr(be.rt, "CHUNK", 4)  # several chunks and a partial last one, even on these sizes
    x, dy = with_nans(rng, shape), with_nans(rng, shape)
    xd, dyd = be.asarray(x), be.asarray(dy)
    y, dx = both_variants(be, monkeypatch, lambda: (be.relu_forward(xd)[0], be.relu_backward(dyd, xd)))
    assert np.array_equal(y, REF.relu_forward(x)[0], equal_nan=True)  # NaN stays NaN
    assert np.array_equal(dx, REF.relu_backward(dy, REF.relu_forward(x)[1]), equal_nan=True)
    p, g, v = with_nans(rng, shape), normal(rng, *shape), normal(rng, *shape)
    for wd in (0.0, 5e-4):

        def sgd(wd=wd):
            p_d, v_d = be.asarray(p), be.asarray(v)
            be.sgd_update(p_d, be.asarray(g), v_d, 0.05, 0.9, wd)
            return p_d, v_d

        p_ref, v_ref = p.copy(), v.copy()
        REF.sgd_update(p_ref, g, v_ref, 0.05, 0.9, wd)
        assert all(
            np.array_equal(a, b, equal_nan=True)
            for a, b in zip(both_variants(be, monkeypatch, sgd), (p_ref, v_ref), strict=True)
        )


@pytest.mark.parametrize("shape", ROW_SHAPES)
@pytest.mark.parametrize("size, beta", [(5, 0.75), (4, 0.6), (1, 0.75)])
@pytest.mark.parametrize("walk", ["planes", 4, 1024])
def test_lrn_rows_kernels_give_the_same_bits(be, rng, monkeypatch, shape, size, beta, walk):
    """Plain and fused LRN, forward and backward; beta 0.75 (square roots, the vectorised build)
    and 0.6 (pow); windows wider than the channels; NaN in x and dy, -0 in dy, go through both
    alike. The backward's CPU kernels: the rows ones (a plane per work-item, launched here in
    place of the walk) and the walk along the channels (4 pixels per work-item: several blocks
    and a partial last one; or a whole plane)."""
    if walk == "planes":
        monkeypatch.setattr(be.rt, "channel_walk", be.rt.planes)
    else:
        monkeypatch.setattr(be.rt, "LRN_BLOCK", walk)
    x, dy = with_nans(rng, shape), with_nans(rng, shape)
    xd, dyd = be.asarray(x), be.asarray(dy)

    def lrn():
        y, (_, _, (_, s, p), *_) = be.lrn_forward(xd, size, 2e-2, beta, 2.0)
        cache = be.lrn_forward(xd, size, 2e-2, beta, 2.0)[1]
        return y, s, p, be.lrn_backward(dyd, cache)

    def relu_lrn():
        y, cache = be.relu_lrn_forward(xd, size, 2e-2, beta, 2.0)
        return y, cache[2][1], be.relu_lrn_backward(dyd, cache)

    both_variants(be, monkeypatch, lrn)
    both_variants(be, monkeypatch, relu_lrn)


@pytest.mark.parametrize("shape", ROW_SHAPES)
@pytest.mark.parametrize("training", [1, 0])
def test_batchnorm_rows_kernels_give_the_same_bits(be, rng, monkeypatch, shape, training):
    """bn_forward and bn_backward against their rows twins on the same statistics (the statistics
    themselves are sums in another order: test_batchnorm_train_then_eval_with_running_stats)."""
    n, c, h, w = shape
    x, dy, xhat = with_nans(rng, shape), normal(rng, *shape), normal(rng, *shape)
    mean, invstd, gamma, beta, dgamma, dbeta = (be.asarray(normal(rng, c)) for _ in range(6))
    xd, dyd, xhatd = be.asarray(x), be.asarray(dy), be.asarray(xhat)

    def run():
        out = [be.rt.empty(shape) for _ in range(3)]
        sizes = (np.int32(c), np.int32(h * w), np.int32(n))
        stats = (mean.data, invstd.data, gamma.data, beta.data)
        be.rt.planes("bn_forward", n, c, h * w, xd.data, *stats, *sizes, out[0].data, out[1].data)
        grads = (dyd.data, xhatd.data, gamma.data, invstd.data, dgamma.data, dbeta.data)
        be.rt.planes("bn_backward", n, c, h * w, *grads, np.int32(training), F32(n * h * w), *sizes, out[2].data)
        return out

    both_variants(be, monkeypatch, run)


# (n, c, h, w, k, stride, pad): odd sizes, strides, paddings, a 1x1 kernel and a kernel as large as the image
CONV_CASES = [
    (1, 1, 3, 5, 3, 1, 1),
    (2, 3, 7, 9, 5, 1, 2),
    (3, 2, 9, 7, 3, 2, 1),
    (2, 3, 11, 10, 5, 2, 2),
    (2, 4, 6, 6, 1, 1, 0),
    (1, 1, 5, 5, 5, 2, 0),
    (1, 2, 4, 21, 3, 1, 1),
]


@pytest.mark.parametrize(
    "n, c, h, w, k, stride, pad",
    CONV_CASES,
)
@pytest.mark.parametrize("nb", [3, 8, 24])
def test_im2col_and_im2row_rows_kernels_write_the_same_panels(be, rng, n, c, h, w, k, stride, pad, nb):
    """im2col_panels_rows (a tap over an image, in runs cut at panel edges) and
    im2row_panels_rows (a panel's block of an image) against the per-element kernels: every
    value of every panel, the zeros past the last column and the column of ones too; panels
    narrower than a row, wider than several rows, and 1x1 (conv_dx's dy panels)."""
    from backends.opencl import conv

    x = with_nans(rng, (n, c, h, w))
    oh, ow = (h + 2 * pad - k) // stride + 1, (w + 2 * pad - k) // stride + 1
    kdim, npix = c * k * k, n * oh * ow
    xd = be.asarray(x)
    pixel, tap = conv.im2col_tables(be.rt, x.shape, k, k, stride, pad, oh, ow)
    simple, rows = (be.rt.empty((cdiv(npix, nb) * kdim * nb,)) for _ in range(2))
    for out in (simple, rows):
        out.fill(F32(12345.0))  # a value no input has: what a kernel leaves unwritten shows
    i32 = np.int32
    tables = (pixel.data, tap.data, i32(h), i32(w), i32(npix), i32(kdim), i32(nb))
    geometry = (i32(c), i32(h), i32(w), i32(oh), i32(ow), i32(n), i32(nb))
    build = conv.window(k, k, stride, pad)
    be.rt.launch("im2col_panels", (nb, kdim, cdiv(npix, nb)), xd.data, *tables, simple.data)
    be.rt.launch("im2col_panels_rows", (kdim, n), xd.data, *geometry, rows.data, defines=build, rows=True)
    simple, rows = be.to_numpy(simple), be.to_numpy(rows)
    assert not (simple == 12345.0).any()
    assert np.array_equal(simple.view(np.int32), rows.view(np.int32))
    # im2row_panels, [cols^T | 1] for the dW GEMM, the same way
    simple, rows = (be.rt.empty((cdiv(kdim + 1, nb) * npix * nb,)) for _ in range(2))
    for out in (simple, rows):
        out.fill(F32(12345.0))
    be.rt.launch("im2row_panels", (nb, npix, cdiv(kdim + 1, nb)), xd.data, *tables, simple.data)
    be.rt.launch("im2row_panels_rows", (cdiv(kdim + 1, nb), n), xd.data, *geometry, rows.data, defines=build, rows=True)
    simple, rows = be.to_numpy(simple), be.to_numpy(rows)
    assert not (simple == 12345.0).any()
    assert np.array_equal(simple.view(np.int32), rows.view(np.int32))


@pytest.mark.parametrize(
    "n, c, h, w, k, stride, pad",
    [*CONV_CASES, (1, 2, 8, 8, 2, 3, 0)],  # a kernel smaller than its stride too
)
def test_col2im_rows_kernel_gives_the_same_bits(be, rng, n, c, h, w, k, stride, pad):
    """col2im_rows (a work-item per input row, tap by tap) against the per-element col2im gather:
    the same terms in the same order, so the same bits; stride 3 > kernel 2 leaves columns no
    window reads (zero), and NaN in dcols goes where col2im sends it."""
    from backends.opencl import conv

    oh, ow = (h + 2 * pad - k) // stride + 1, (w + 2 * pad - k) // stride + 1
    npix = n * oh * ow
    dcols = be.asarray(with_nans(rng, (c * k * k, npix)))
    i32 = np.int32
    args = (dcols.data, i32(c), i32(h), i32(w), i32(oh), i32(ow), i32(npix), i32(n * c))
    out = {}
    for name, dims in (("col2im", (w, h, n * c)), ("col2im_rows", (h, n * c))):
        dx = be.rt.empty((n, c, h, w))
        dx.fill(F32(12345.0))
        be.rt.launch(name, dims, *args, dx.data, defines=conv.window(k, k, stride, pad))
        out[name] = be.to_numpy(dx)
    assert not (out["col2im"] == 12345.0).any()
    assert np.array_equal(out["col2im"].view(np.int32), out["col2im_rows"].view(np.int32))


def test_batchnorm_refuses_one_value_per_channel_in_training(be, rng):
    """N*H*W == 1 has no batch variance: training raises ValueError (as torch does) before the
    running statistics move; eval mode takes it; N*H*W == 2 trains, whichever axis holds the 2."""
    c = 3
    gamma, beta = normal(rng, c), normal(rng, c)
    rm, rv = normal(rng, c), (rng.random(c) + 0.5).astype(F32)
    g_d, b_d, rm_d, rv_d = be.asarray(gamma), be.asarray(beta), be.asarray(rm), be.asarray(rv)
    x = normal(rng, 1, c, 1, 1)
    with pytest.raises(ValueError, match=r"more than 1 value per channel.*batch of 2 or more, or use eval mode"):
        be.batchnorm_forward(be.asarray(x), g_d, b_d, rm_d, rv_d, True)
    check(be, rm_d, Expected(rm, 0), what="running_mean")
    check(be, rv_d, Expected(rv, 0), what="running_var")
    k = 2 * (2 * 2 + 8 + 2 * FN) + 2 + 3 + 2 * FN  # as in the test above: two updates on N*H*W = 2, then dgamma
    for shape, training in (((1, c, 1, 1), False), ((2, c, 1, 1), True), ((1, c, 1, 2), True)):
        x, dy = normal(rng, *shape), normal(rng, *shape)
        y_ref, cache_ref = REF.batchnorm_forward(x, gamma, beta, rm, rv, training)
        y, cache = be.batchnorm_forward(be.asarray(x), g_d, b_d, rm_d, rv_d, training)
        check(be, y, Expected(y_ref, k), what=f"y {shape}")
        check(be, rv_d, Expected(rv, k), what=f"running_var {shape}")
        dx_ref, dgamma_ref, _ = REF.batchnorm_backward(dy, cache_ref)
        dx, dgamma, _ = be.batchnorm_backward(be.asarray(dy), cache)
        check(be, dx, Expected(dx_ref, k), what=f"dx {shape}")
        check(be, dgamma, Expected(dgamma_ref, k), what=f"dgamma {shape}")


# ------------------------------------------------------------------ dense, loss, optimiser


@pytest.mark.parametrize("x_shape, m", [((2, 3, 4, 4), 5), ((1, 10), 3), ((4, 6, 3, 3), 7), ((3, 700), 2)])
def test_linear_matches_numpy(be, rng, x_shape, m):
    d = int(np.prod(x_shape[1:]))
    x, w, b = normal(rng, *x_shape), normal(rng, m, d, scale=0.3), normal(rng, m)
    y, cache = be.linear_forward(be.asarray(x), be.asarray(w), be.asarray(b))
    dy = normal(rng, x_shape[0], m)
    y_ref, dx_ref, dw_ref, db_ref = linear_expected(x, w, b, dy)  # with their rigorous bounds
    check(be, y, y_ref, what="y")
    dx, dw, db = be.linear_backward(be.asarray(dy), cache)
    check(be, dx, dx_ref, what="dx")  # in x's original shape
    check(be, dw, dw_ref, what="dw")
    check(be, db, db_ref, what="db")


@pytest.mark.parametrize("n, k, scale", [(4, 10, 1.0), (1, 3, 1.0), (5, 7, 30.0)])
def test_softmax_cross_entropy_matches_numpy(be, rng, n, k, scale):
    logits, labels = normal(rng, n, k, scale=scale), rng.integers(0, k, size=n)
    loss_ref, d_ref = REF.softmax_cross_entropy(logits, labels)
    loss, d = be.softmax_cross_entropy(be.asarray(logits), labels)
    k_ce = k + n + 3 + 2 * FN  # softmax_ce's k (backends.conformance.runner)
    assert isinstance(loss, float)
    assert_close(np.asarray(loss), Expected(np.asarray(loss_ref), k_ce), "loss")
    check(be, d, Expected(d_ref, k_ce))


def test_sgd_update_is_numpys_arithmetic(be, rng):
    for lr, momentum, wd in ((0.05, 0.9, 5e-4), (0.1, 0.0, 0.0)):
        p, v = normal(rng, 6, 3, 5, 5), np.zeros((6, 3, 5, 5), F32)
        p_d, v_d = be.asarray(p), be.asarray(v)
        for _ in range(3):
            g = normal(rng, *p.shape)
            REF.sgd_update(p, g, v, lr, momentum, wd)
            assert be.sgd_update(p_d, be.asarray(g), v_d, lr, momentum, wd) is None  # in place
        check(be, p_d, Expected(p, 0), what="param")
        check(be, v_d, Expected(v, 0), what="velocity")


# ------------------------------------------------------------------ a small network trains like numpy


@pytest.mark.parametrize("norm, pool_kernel", [("lrn", 3), ("batch", 2)])
def test_small_paper_net_trains_like_numpy(be, norm, pool_kernel):
    from tinyconv.model import paper_net

    rng = np.random.default_rng(7)
    x = rng.standard_normal((4, 3, 32, 32)).astype(F32)
    labels = rng.integers(0, 10, size=4)
    losses = {}
    for name, backend in (("numpy", REF), ("opencl", be)):
        net = paper_net("8:16", backend, norm, seed=3, pool_kernel=pool_kernel)
        velocity = {key: backend.zeros(layer.params[p].shape) for key, layer, p in net.named_params()}
        xd, out = backend.asarray(x), []
        for _ in range(4):
            loss = net.train_step(xd, labels)
            out.append(loss)
            for key, layer, p in net.named_params():
                wd = 5e-4 if p in layer.decay else 0.0
                backend.sgd_update(layer.params[p], layer.grads[p], velocity[key], 0.05, 0.9, wd)
        losses[name] = np.array(out)
        if name == "opencl":  # the weights stayed on the device the whole time
            assert all(isinstance(layer.params[p], cla.Array) for _, layer, p in net.named_params())
    assert losses["numpy"][-1] < losses["numpy"][0]  # it does learn this batch
    # float32_tolerance's scale form, k along the path (docs/writing-a-backend.md's table): a loss is the forward's
    # conv1, norm, conv2, norm, fc 16*8*8 and softmax; each step before it adds the way back to conv1's
    # dw (4*32*32 sums through fc, the pools' overlaps, the norms, conv2's dx 16*5*5) and the update
    if norm == "lrn":
        fwd, back = [5 + 3 + FN] * 2, [2 * 5 + 7 + 2 * FN] * 2
    else:  # batch norm over N*H*W = 4*32*32, then 4*16*16
        fwd, back = [2 * m + 8 + 2 * FN for m in (4096, 1024)], [3 * m + 14 + 2 * FN for m in (4096, 1024)]
    overlaps = 4 if pool_kernel == 3 else 1
    loss_k = (3 * 25 + 1) + fwd[0] + (8 * 25 + 1) + fwd[1] + (16 * 8 * 8 + 1) + (10 + 4 + 3 + 2 * FN)
    step_k = loss_k + 10 + overlaps + back[1] + 16 * 25 + overlaps + back[0] + 4 * 32 * 32 + 6
    for i in range(4):
        assert_close(losses["opencl"][i], Expected(losses["numpy"][i], i * step_k + loss_k), f"step {i}'s loss")


# ------------------------------------------------------------------ edges, errors, description


def test_edges_and_describe(be, rng):
    a = rng.standard_normal((3, 5)).astype(np.float64).T  # float64 and not contiguous
    got = be.to_numpy(be.asarray(a))
    assert got.dtype == F32 and np.array_equal(got, a.astype(F32))
    ints = rng.integers(0, 10, size=6)
    assert np.array_equal(be.to_numpy(be.asarray(ints)), ints)
    assert np.array_equal(be.to_numpy(be.zeros((2, 3))), np.zeros((2, 3), F32))
    d = be.describe()
    assert d["backend"] == "opencl" == be.name and d["kind"] in ("cpu", "gpu", "accelerator", "other")
    for key in ("device", "platform", "opencl_version", "driver"):
        assert isinstance(d[key], str) and d[key]
    assert isinstance(d["compute_units"], int) and d["compute_units"] >= 1
    be.synchronize()


def test_bad_input_gets_a_clear_error(be, rng):
    x = normal(rng, 1, 3, 8, 8)
    w, b = be.asarray(normal(rng, 4, 3, 3, 3)), be.zeros((4,))
    with pytest.raises(TypeError, match="backend.asarray"):
        be.conv2d_forward(x, w, b, 1, 1)  # a host array
    with pytest.raises(ValueError, match="does not match weights"):
        be.conv2d_forward(be.asarray(normal(rng, 1, 2, 8, 8)), w, b, 1, 1)
    with pytest.raises(ValueError, match="does not fit"):
        be.conv2d_forward(be.asarray(normal(rng, 1, 3, 2, 2)), w, b, 1, 0)
    with pytest.raises(ValueError, match=r"labels must be 2 ints in \[0, 3\)"):
        be.softmax_cross_entropy(be.asarray(normal(rng, 2, 3)), np.array([0, 3]))
    p = be.asarray(normal(rng, 6))
    with pytest.raises(ValueError, match="in place"):
        be.sgd_update(p[1:4], be.zeros((3,)), be.zeros((3,)), 0.1, 0.9, 0.0)
    with pytest.raises(ValueError, match="not a non-empty range"):
        be.take_kernels(w, 3, 9)


def test_registry_builds_the_backend(be):
    other = get_backend("opencl", device=be.describe()["device"], autotune=False)
    assert isinstance(other, OpenCLBackend) and other.rt.device == be.rt.device
    with pytest.raises(ValueError, match="another OpenCL context"):
        other.relu_forward(be.zeros((3,)))


# ------------------------------------------------------------------ device listing and choice


def test_list_and_select_devices(monkeypatch):
    devices = list_devices()
    assert devices and {
        "spec",
        "platform_index",
        "device_index",
        "name",
        "kind",
        "compute_units",
        "platform",
        "global_mem_bytes",
    } <= set(devices[0])
    first = devices[0]
    assert select_device(first["spec"]).name.strip() == first["name"]
    assert select_device(first["name"][:12].swapcase()).name.strip() == first["name"]  # a name substring
    assert device.device_kind(select_device(first["kind"])) == first["kind"]
    monkeypatch.setenv(device.ENV_DEVICE, first["spec"])
    assert select_device().name.strip() == first["name"]
    monkeypatch.delenv(device.ENV_DEVICE)
    gpus = [d for d in devices if d["kind"] == "gpu"]
    assert select_device().name.strip() == (gpus or devices)[0]["name"]  # first GPU, else first device
    with pytest.raises(ValueError, match=f"matches 'no-such-device'.*Devices: {first['spec']}"):
        select_device("no-such-device")
    with pytest.raises(ValueError, match="no OpenCL device '9:9'"):
        select_device("9:9")


def test_no_opencl_runtime_says_how_to_install_one(monkeypatch):
    def no_platform():
        raise cl.LogicError("clGetPlatformIDs failed: PLATFORM_NOT_FOUND_KHR")

    monkeypatch.setattr(device.cl, "get_platforms", no_platform)
    with pytest.raises(NoOpenCLDevice, match="pip install pocl-binary-distribution") as info:
        OpenCLBackend()
    assert isinstance(info.value, RuntimeError) and "ICD" in str(info.value)
    monkeypatch.setattr(device.cl, "get_platforms", lambda: [])
    with pytest.raises(NoOpenCLDevice, match="no devices"):
        list_devices()


def test_pack_layout_is_panels(be, rng):
    """The B-panel layout every GEMM reads: panel q is rows x [q*nb, (q+1)*nb), zero-padded."""
    k, n, nb = 3, 10, 4
    b = normal(rng, k, n)
    panels = be.to_numpy(be.rt.pack(be.asarray(b), k, n, n, 1, nb)).reshape(cdiv(n, nb), k, nb)
    padded = np.zeros((k, cdiv(n, nb) * nb), F32)
    padded[:, :n] = b
    assert np.array_equal(panels, padded.reshape(k, cdiv(n, nb), nb).transpose(1, 0, 2))


# ---- im2col_panels_lanes and im2row_panels_lanes (layout.cl): 8 pixels of an output row a vector,
# for stride 1 or 2 with OW and NB multiples of 8 (conv.lanes_fit), against the per-element kernels.
@pytest.mark.parametrize(
    "n, c, h, w, k, stride, pad",
    [
        (1, 1, 1, 8, 3, 1, 1),  # one input row: every row_lanes reads the first and last row of x (clamped)
        (2, 3, 5, 8, 5, 1, 2),  # rows shorter than the window, padding 2 on every side
        (3, 2, 7, 16, 3, 1, 1),  # odd heights, two vectors a row
        (2, 3, 9, 12, 5, 1, 0),  # no padding: OW = 8 from W = 12
        (2, 4, 3, 24, 1, 1, 0),  # 1x1: im2row's column of ones lands mid-panel
        (1, 10, 2, 8, 5, 1, 2),  # Kdim 250 > NB: several im2row panels, the last (NB 8) with 2 taps and the ones
        (2, 3, 15, 15, 3, 2, 1),  # stride 2: 16-float loads, odd W, the last lanes past the row
        (1, 2, 6, 19, 4, 2, 0),  # stride 2, even window, no padding: the last input column never read
    ],
)
@pytest.mark.parametrize("nb", [8, 24, 64])
def test_im2col_and_im2row_lanes_kernels_write_the_same_panels(be, rng, n, c, h, w, k, stride, pad, nb):
    """Every value of every panel bit for bit, NaN and -0 included: panels that end mid-row or
    mid-image, a last panel partly past N*OH*OW (zeros), the bias column of ones and the zeros after it."""
    from backends.opencl import conv

    x = with_nans(rng, (n, c, h, w))
    x.flat[-1] = -0.0  # the last float of x: read by the last row's clamped loads
    oh, ow = (h + 2 * pad - k) // stride + 1, (w + 2 * pad - k) // stride + 1
    kdim, npix = c * k * k, n * oh * ow
    assert conv.lanes_fit(k, k, stride, ow, nb, True) and conv.lanes_fit(k, k, stride, ow, nb, False) == (k > 1)
    xd = be.asarray(x)
    pixel, tap = conv.im2col_tables(be.rt, x.shape, k, k, stride, pad, oh, ow)
    i32 = np.int32
    shape, build = (c, h, w, oh, ow, n, nb), conv.window(k, k, stride, pad)
    panels_t = (cdiv(kdim + 1, nb), n)  # im2row_panels_lanes' grid: a work-item per panel and image
    for simple_name, simple_dims, lanes_name, lanes_dims, size in (
        ("im2col_panels", (nb, kdim, cdiv(npix, nb)), "im2col_panels_lanes", (cdiv(npix, nb),), cdiv(npix, nb) * kdim),
        ("im2row_panels", (nb, npix, cdiv(kdim + 1, nb)), "im2row_panels_lanes", panels_t, panels_t[0] * npix),
    ):
        simple, lanes = (be.rt.empty((size * nb,)) for _ in range(2))
        for out in (simple, lanes):
            out.fill(F32(12345.0))  # a value no input has: what a kernel leaves unwritten shows
        tables = (pixel.data, tap.data, i32(h), i32(w), i32(npix), i32(kdim), i32(nb))
        be.rt.launch(simple_name, simple_dims, xd.data, *tables, simple.data)
        be.rt.launch(lanes_name, lanes_dims, xd.data, *map(i32, shape), lanes.data, defines=build, rows=True)
        simple, lanes = be.to_numpy(simple), be.to_numpy(lanes)
        assert not (simple == 12345.0).any()
        assert np.array_equal(simple.view(np.int32), lanes.view(np.int32)), lanes_name


def test_lanes_fit_refuses_what_the_lanes_kernels_cannot_take():
    from backends.opencl.conv import lanes_fit

    assert lanes_fit(5, 5, 1, 16, 16, False) and lanes_fit(5, 5, 1, 32, 24, True) and lanes_fit(3, 3, 2, 8, 8, True)
    assert not lanes_fit(5, 5, 3, 16, 16, False)  # stride 3: the row walk
    assert not lanes_fit(5, 5, 1, 12, 16, True)  # OW not a multiple of 8
    assert not lanes_fit(5, 5, 1, 16, 12, False)  # NB not a multiple of 8
    assert not lanes_fit(5, 5, 1, 16, 72, True) and lanes_fit(5, 5, 1, 16, 72, False)  # im2row's tap arrays: 64
    assert not lanes_fit(1, 1, 1, 16, 16, False) and lanes_fit(1, 1, 1, 16, 16, True)  # 1x1 im2col: the walk


@pytest.mark.parametrize(
    "n, c, h, w, f, k, stride, pad", [(2, 2, 5, 8, 3, 5, 1, 2), (3, 2, 3, 16, 2, 3, 1, 1), (2, 2, 4, 15, 3, 3, 2, 1)]
)
def test_conv2d_with_the_lanes_kernels_gives_the_per_element_bits(be, rng, monkeypatch, n, c, h, w, f, k, stride, pad):
    """The convolution end to end, forward and backward, as conv.py launches its kernels on CPUs (lanes
    where they fit, with the GEMM's own NB) and on GPUs: the same panels, so the same GEMMs' bits."""
    x, wt, b = be.asarray(normal(rng, n, c, h, w)), be.asarray(normal(rng, f, c, k, k)), be.asarray(normal(rng, f))
    dy = be.asarray(normal(rng, n, f, (h + 2 * pad - k) // stride + 1, (w + 2 * pad - k) // stride + 1))

    def run():
        y, cache = be.conv2d_forward(x, wt, b, stride, pad)
        return (y, *be.conv2d_backward(dy, cache, True))

    both_variants(be, monkeypatch, run)


# ---- col2im_lanes (layout.cl): 8 dx elements of an input row a vector, stride 1, W a multiple of 8
# (conv.col2im_lanes_fit), against the per-element col2im gather.
@pytest.mark.parametrize(
    "n, c, h, w, k, pad",
    [
        (1, 1, 1, 8, 3, 1),  # one plane of one row: every load at the first or last float of dcols (clamped)
        (2, 3, 5, 8, 5, 2),  # rows shorter than the window, padding 2 on every side
        (3, 2, 7, 16, 3, 1),  # odd heights, two vectors a row
        (2, 3, 9, 16, 5, 0),  # no padding: OW = 12, not a multiple of 8; the last lanes of a row read past it
        (1, 2, 5, 8, 5, 0),  # OW = 4, OH = 1: half of every vector masked
        (2, 5, 4, 24, 1, 0),  # 1x1: one tap, a plain copy
        (1, 3, 6, 8, 2, 1),  # an even window: OW = W + 1, the last output column read by the first lane only
        (2, 2, 3, 8, 4, 2),  # padding 2 with a 4-wide window: OW = 9, vectors straddle output rows
    ],
)
def test_col2im_lanes_kernel_gives_the_same_bits(be, rng, n, c, h, w, k, pad):
    """col2im_lanes against col2im bit for bit, NaN and -0 in dcols included: the same terms in
    the same order, the masked lanes' +0.0 changing nothing; every dx element written."""
    from backends.opencl import conv

    oh, ow = h + 2 * pad - k + 1, w + 2 * pad - k + 1
    npix = n * oh * ow
    assert conv.col2im_lanes_fit(1, w, c * k * k, npix)
    dcols = with_nans(rng, (c * k * k, npix))
    dcols.flat[-1] = -0.0  # the last float of dcols: read by the last row's clamped loads
    dcols[:, rng.random(npix) < 0.2] = -0.0  # whole columns of -0: sums of -0 only
    dd = be.asarray(dcols)
    i32 = np.int32
    args = (dd.data, i32(c), i32(h), i32(w), i32(oh), i32(ow), i32(npix), i32(n * c))
    out = {}
    for name, dims in (("col2im", (w, h, n * c)), ("col2im_lanes", (h, n * c))):
        dx = be.rt.empty((n, c, h, w))
        dx.fill(F32(12345.0))  # a value no sum has: what a kernel leaves unwritten shows
        be.rt.launch(name, dims, *args, dx.data, defines=conv.window(k, k, 1, pad), rows=name != "col2im")
        out[name] = be.to_numpy(dx)
    assert not (out["col2im"] == 12345.0).any()
    assert np.array_equal(out["col2im"].view(np.int32), out["col2im_lanes"].view(np.int32))


def test_col2im_lanes_fit_refuses_what_col2im_lanes_cannot_take():
    from backends.opencl.conv import col2im_lanes_fit

    assert col2im_lanes_fit(1, 16, 1250, 16384) and col2im_lanes_fit(1, 8, 1, 1)
    assert not col2im_lanes_fit(2, 16, 1250, 16384)  # stride 2: col2im_rows
    assert not col2im_lanes_fit(1, 12, 1250, 16384)  # W not a multiple of 8
    assert not col2im_lanes_fit(1, 16, 2**16, 2**15)  # dcols past int32 indices


def test_a_launch_sets_its_arguments_and_enqueues_under_the_runtimes_lock(be):
    """In-process workers may share one backend. A launch sets a shared Kernel's arguments, then enqueues it; two
    threads interleaving those (a ReLU of one thread's map ran with the other's buffers, in a script of two threads
    switching every 10 us) is kept out by making each launch under one lock."""
    held = []
    be.rt.enqueue(
        lambda queue, grid, local, *args: held.append((queue is be.rt.queue, be.rt._launching.locked())), (1,), None
    )
    assert held == [(True, True)] and not be.rt._launching.locked()
