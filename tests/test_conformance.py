"""The conformance suite (backends.conformance.runner): that it runs every op, that it fails on broken
backends, and its verdict on the real ones -- numpy (against itself), OpenCL, and the
out-of-tree example backend in examples/threaded_backend/."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

import backends.opencl
from backends import get_backend
from backends.base import Backend
from backends.conformance.runner import (
    CASES,
    CheckResult,
    assert_conforms,
    conformance_tests,
    format_table,
    main,
    run_case,
    run_conformance,
)
from backends.numpy_backend import NumpyBackend, _channel_window_sum

ROOT = Path(__file__).resolve().parent.parent

# ------------------------------------------------------------------ the suite on real backends

test_numpy_conforms = conformance_tests("numpy")


def opencl_backend() -> Backend:
    """The OpenCL backend, or a skip that says why there is none on this machine."""
    if not hasattr(backends.opencl, "OpenCLBackend"):
        pytest.skip("backends.opencl does not define OpenCLBackend yet (the OpenCL backend is unfinished)")
    try:
        return get_backend("opencl")
    except RuntimeError as e:  # backends.opencl.NoOpenCLDevice
        pytest.skip(f"no OpenCL device: {e}")


test_opencl_conforms = conformance_tests(opencl_backend)  # one instance for every case


def load_example_backend() -> type[Backend]:
    """examples/threaded_backend/tinyconv_threaded.py by path: no installation needed."""
    path = ROOT / "examples" / "threaded_backend" / "tinyconv_threaded.py"
    spec = importlib.util.spec_from_file_location("_example_threaded_backend", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.ThreadedBackend


test_threaded_example_conforms = conformance_tests(lambda: load_example_backend()(threads=3))


def test_threaded_example_describes_itself_and_rejects_bad_options():
    cls = load_example_backend()
    d = cls(threads=2).describe()
    assert d["backend"] == "threaded" and d["threads"] == 2
    with pytest.raises(ValueError, match="threads"):
        cls(threads=0)


# ------------------------------------------------------------------ the suite covers every op


OPS = sorted(Backend.__abstractmethods__ | {"take_kernels", "conv2d_partial"})


class Spy(NumpyBackend):
    """The reference, recording which Backend methods the suite calls."""

    def __init__(self) -> None:
        self.called: set[str] = set()


def _spied(name: str):
    def method(self, *args, **kwargs):
        self.called.add(name)
        return getattr(NumpyBackend, name)(self, *args, **kwargs)

    return method


for _name in OPS:
    setattr(Spy, _name, _spied(_name))


def test_suite_calls_every_op_of_the_interface():
    spy = Spy()
    results = run_conformance(spy)
    assert all(r.passed for r in results), format_table([r for r in results if not r.passed])
    assert spy.called == set(OPS), f"never called: {set(OPS) - spy.called}"
    ops = {c.op for c in CASES}
    stems = {n.removesuffix("_forward").removesuffix("_backward") for n in OPS} - {"to_numpy"}
    assert stems <= ops  # each op has cases of its own, named after it


def test_case_ids_are_unique_and_every_case_checks_something():
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids))
    assert len(run_conformance("numpy")) > 2 * len(CASES)


def test_shapes_cover_the_edges():
    labels = " | ".join(c.label for c in CASES if c.op in ("conv2d", "maxpool"))
    for needle in ("N1 ", "s2", "p0", "p1", "p2", "ties", "nan", "no-dx"):
        assert needle in labels
    assert any(c.op == "batchnorm" and c.label.endswith("refused") for c in CASES)


def test_nan_cases_hold_nan_windows_with_two_nans_and_nan_free_ones():
    """What the NaN cases are for: the reference's y has NaNs and numbers, and one window's two
    NaNs (its first and last corner) send its gradient to the last one."""
    for case in (c for c in CASES if c.op == "maxpool" and c.label.endswith(" nan")):
        rec = RecordingReference()
        assert all(r.passed for r in run_case(rec, case))
        x, y, dx = rec.x, rec.y, rec.dx_of_window_1_1
        assert np.isnan(y).any() and not np.isnan(y).all()
        kernel, stride, padding = (int(v[1:]) for v in case.label.split()[3:6])
        top = stride - padding
        first, last = (0, 0, top, top), (0, 0, top + kernel - 1, top + kernel - 1)
        assert np.isnan(x[first]) and np.isnan(x[last]) and np.isnan(y[0, 0, 1, 1])
        assert dx[last] == 1 and dx.sum() == 1


class RecordingReference(NumpyBackend):
    """The reference, keeping the max pool's input and output, and the gradient that output (1, 1) of
    image 0, channel 0 alone sends back."""

    def maxpool_forward(self, x, kernel=2, stride=2, padding=0):
        y, cache = super().maxpool_forward(x, kernel, stride, padding)
        one = np.zeros_like(y)
        one[0, 0, 1, 1] = 1
        self.x, self.y, self.dx_of_window_1_1 = x.copy(), y.copy(), super().maxpool_backward(one, cache)
        return y, cache


# ------------------------------------------------------------------ the suite fails broken backends


class DiagonalLRN(NumpyBackend):
    """lrn_backward without the cross-channel term: the classic wrong LRN gradient."""

    def lrn_backward(self, dy, cache):
        x, y, s, p, size, alpha, beta, before, after = cache
        return dy * p - np.float32(2.0 * alpha * beta / size) * x * (dy * y / s)


class UnmirroredLRN(NumpyBackend):
    """lrn_backward summing over window(j) instead of {i : j in window(i)}: wrong for even sizes."""

    def lrn_backward(self, dy, cache):
        x, y, s, p, size, alpha, beta, before, after = cache
        t = _channel_window_sum(dy * y / s, before, after)
        return dy * p - np.float32(2.0 * alpha * beta / size) * x * t


class TiesToEveryMax(NumpyBackend):
    """maxpool_backward that gives dy to every input equal to the window's max."""

    def maxpool_forward(self, x, kernel=2, stride=2, padding=0):
        y, _ = super().maxpool_forward(x, kernel, stride, padding)
        return y, (x, y, kernel, stride, padding)

    def maxpool_backward(self, dy, cache):
        x, y, k, s, p = cache
        h, w = x.shape[2:]
        oh, ow = y.shape[2:]
        xp = np.pad(x, ((0, 0), (0, 0), (p, p), (p, p)), constant_values=-np.inf)
        dxp = np.zeros(xp.shape, np.float32)
        for i in range(k):
            for j in range(k):
                window = (slice(None), slice(None), slice(i, i + s * oh, s), slice(j, j + s * ow, s))
                dxp[window] += dy * (xp[window] == y)
        return dxp[:, :, p : p + h, p : p + w]


class NaNDropped(NumpyBackend):
    """A max pool that skips NaNs (as np.fmax would): every window outputs its largest number."""

    def maxpool_forward(self, x, kernel=2, stride=2, padding=0):
        return super().maxpool_forward(np.where(np.isnan(x), np.float32(-np.inf), x), kernel, stride, padding)


class NaNGradientToTheMax(NumpyBackend):
    """A max pool whose NaN windows output NaN but send their gradient to the window's largest number."""

    def maxpool_forward(self, x, kernel=2, stride=2, padding=0):
        y, _ = super().maxpool_forward(x, kernel, stride, padding)
        _, cache = super().maxpool_forward(np.where(np.isnan(x), np.float32(-np.inf), x), kernel, stride, padding)
        return y, cache


class NaNGradientToTheFirstNaN(NumpyBackend):
    """A max pool routing a NaN window's gradient to its first NaN (torch: the last)."""

    def maxpool_forward(self, x, kernel=2, stride=2, padding=0):
        y, cache = super().maxpool_forward(x, kernel, stride, padding)
        return y, (cache, x, kernel, stride, padding)

    def maxpool_backward(self, dy, cache):
        cache, x, k, s, p = cache
        dx = super().maxpool_backward(dy, cache)
        h, w = x.shape[2:]
        for n, c, oh, ow in np.ndindex(*dy.shape):
            r0, q0 = oh * s - p, ow * s - p
            window = [(r, q) for r in range(max(r0, 0), min(r0 + k, h)) for q in range(max(q0, 0), min(q0 + k, w))]
            nans = [rq for rq in window if np.isnan(x[(n, c, *rq)])]
            if nans:  # move this window's gradient from its last NaN to its first
                dx[(n, c, *nans[-1])] -= dy[n, c, oh, ow]
                dx[(n, c, *nans[0])] += dy[n, c, oh, ow]
        return dx


class OneValueBatchNorm(NumpyBackend):
    """batchnorm_forward that trains on one value per channel instead of refusing: every output is
    beta (the value minus its own mean), and the running statistics move."""

    def batchnorm_forward(self, x, gamma, beta, running_mean, running_var, training, momentum=0.1, eps=1e-5):
        if training and x.shape[0] * x.shape[2] * x.shape[3] == 1:
            twice = np.concatenate([x, x])  # the same batch statistics, without the refusal
            y, cache = super().batchnorm_forward(twice, gamma, beta, running_mean, running_var, True, momentum, eps)
            return y[:1], cache
        return super().batchnorm_forward(x, gamma, beta, running_mean, running_var, training, momentum, eps)


class InPlaceReLU(NumpyBackend):
    """relu_forward that overwrites its input: right values, broken contract."""

    def relu_forward(self, x):
        np.maximum(x, 0, out=x)
        return x, x


class Float64Linear(NumpyBackend):
    """linear_forward that returns float64: right values, wrong dtype."""

    def linear_forward(self, x, w, b):
        y, cache = super().linear_forward(x, w, b)
        return y.astype(np.float64), cache


class BrokenConv(NumpyBackend):
    def conv2d_backward(self, dy, cache, need_dx=True):
        raise NotImplementedError("dx is on my list")


def failures(backend: Backend) -> list[CheckResult]:
    return [r for r in run_conformance(backend) if not r.passed]


def test_fails_a_diagonal_only_lrn_backward():
    failed = failures(DiagonalLRN())
    # the fused ReLU + LRN, inherited as the composition, fails with its LRN
    assert failed and {(r.op, r.output) for r in failed} == {("lrn", "dx"), ("relu_lrn", "dx")}
    large_alpha = {c.label for c in CASES if c.op == "lrn" and "alpha0.01" in c.label}
    assert large_alpha <= {r.case for r in failed}


def test_fails_an_unmirrored_lrn_window_on_even_sizes_only():
    failed = failures(UnmirroredLRN())
    assert failed and {(r.op, r.output) for r in failed} == {("lrn", "dx"), ("relu_lrn", "dx")}
    assert all("size4" in r.case for r in failed)


def test_fails_maxpool_ties_routed_to_every_maximum():
    failed = failures(TiesToEveryMax())
    assert failed and {(r.op, r.output) for r in failed} == {("maxpool", "dx")}
    ties = {c.label for c in CASES if c.op == "maxpool" and c.label.endswith("ties")}
    assert ties <= {r.case for r in failed}
    # without ties it is right, but for NaN windows, where x == max never holds, and for
    # windows of -inf alone, where every input ties
    assert all(r.case.endswith(("ties", "nan", "-inf")) for r in failed)


NAN_CASES = {c.label for c in CASES if c.op == "maxpool" and c.label.endswith(" nan")}


def test_fails_a_maxpool_that_drops_nan():
    failed = failures(NaNDropped())
    assert {(r.op, r.output) for r in failed} == {("maxpool", "y"), ("maxpool", "dx")}
    assert {r.case for r in failed} == NAN_CASES
    assert all(r.note.startswith("NaN differs from the reference") for r in failed if r.output == "y")


@pytest.mark.parametrize("broken", [NaNGradientToTheMax, NaNGradientToTheFirstNaN])
def test_fails_a_maxpool_that_routes_a_nan_windows_gradient_elsewhere(broken):
    """To the largest number, or to the first of the window with two NaNs: only dx is wrong."""
    failed = failures(broken())
    assert {(r.op, r.output) for r in failed} == {("maxpool", "dx")}
    assert {r.case for r in failed} == NAN_CASES


def test_fails_a_batchnorm_that_trains_on_one_value_per_channel():
    failed = failures(OneValueBatchNorm())
    refused = [c.label for c in CASES if c.op == "batchnorm" and c.label.endswith("refused")]
    assert {(r.op, r.case) for r in failed} == {("batchnorm", label) for label in refused}
    assert {r.output for r in failed} == {"refuses", "running_mean kept", "running_var kept"}
    assert "returned instead of raising ValueError" in {r.note for r in failed}


class RaisingBatchNorm(NumpyBackend):
    """Refuses one value per channel with the wrong exception type."""

    def batchnorm_forward(self, x, gamma, beta, running_mean, running_var, training, momentum=0.1, eps=1e-5):
        if training and x.shape[0] * x.shape[2] * x.shape[3] == 1:
            raise ZeroDivisionError("variance of one value")
        return super().batchnorm_forward(x, gamma, beta, running_mean, running_var, training, momentum, eps)


def test_a_refusal_must_be_a_value_error():
    failed = failures(RaisingBatchNorm())
    assert [(r.op, r.output, r.note) for r in failed] == [
        ("batchnorm", "raised", "ZeroDivisionError: variance of one value")
    ]


def test_fails_an_op_that_modifies_its_input():
    failed = failures(InPlaceReLU())
    assert failed and {(r.op, r.output) for r in failed} == {("relu", "inputs kept"), ("relu_lrn", "inputs kept")}
    assert all(r.note == "modified: x" for r in failed)


def test_fails_a_wrong_dtype_and_a_raising_op_and_keeps_going():
    failed = failures(Float64Linear())
    assert failed and {(r.op, r.output) for r in failed} == {("linear", "y")}
    assert "dtype float64" in failed[0].note
    failed = failures(BrokenConv())
    assert {(r.op, r.output) for r in failed} == {("conv2d", "raised"), ("conv2d_partial", "raised")}
    assert len(failed) == sum(c.op in ("conv2d", "conv2d_partial") for c in CASES)
    assert "NotImplementedError: dx is on my list" in failed[0].note


def test_assert_conforms_prints_the_table_and_raises(capsys):
    assert_conforms(NumpyBackend())
    assert "passed, 0 failed" in capsys.readouterr().out
    with pytest.raises(AssertionError, match="lrn .* dx"):
        assert_conforms(DiagonalLRN())
    assert "FAIL" in capsys.readouterr().out


# ------------------------------------------------------------------ the command line


def test_main_exits_0_with_the_table(capsys):
    assert main(["--backend", "numpy"]) == 0
    out = capsys.readouterr().out
    assert "max abs err" in out and "conv2d" in out and ", 0 failed" in out


def test_main_exits_1_on_an_unknown_backend(capsys):
    assert main(["--backend", "no-such-backend"]) == 1
    assert "unknown backend 'no-such-backend'" in capsys.readouterr().err
