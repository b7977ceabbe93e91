"""Conv blocks on kernel slices (tinyconv/distributed/shard/block.py): with the halo, slices give the unsharded numbers.

The reference is the plain layer sequence conv -> tail on all kernels; each case cuts
the kernels into slices (some narrower than the halo, some at the edges), computes each
slice's block on its own, and checks the concatenated outputs, the concatenated dW/db
rows and the summed partial dX against it; and likewise for the convolution cut by input channels
into partial sums, with the tails run on kernel slices of their total.
"""

from __future__ import annotations

import numpy as np
import pytest
from float32_expected import Expected
from float32_expected import assert_close as within_round_off

from backends.conformance.runner import FN
from backends.numpy_backend import NumpyBackend
from tinyconv.distributed.protocol import VERSION
from tinyconv.distributed.shard.balance import slices
from tinyconv.distributed.shard.block import (
    block_backward,
    block_forward,
    halo_span,
    halo_width,
    tail_backward,
    tail_forward,
    tail_output_hw,
)
from tinyconv.distributed.shard.by_channels import halo_sum, owned
from tinyconv.distributed.shard.cluster import Cluster
from tinyconv.distributed.shard.layer import ShardedBlock, tail_of
from tinyconv.distributed.worker.handler import Worker
from tinyconv.distributed.worker.state import check_tail
from tinyconv.layers import BatchNorm2D, Conv2D, LocalResponseNorm, MaxPool2D, ReLU
from tinyconv.model import Network, paper_net
from tinyconv.optim import SGD
from transports.inproc import InprocTransport

TIMEOUT = 20.0
RELU = {"op": "relu"}
POOL = {"op": "maxpool", "kernel": 3, "stride": 2, "padding": 1}


def lrn(size: int) -> dict:
    # a large alpha makes the cross-channel terms matter: a wrong halo would show
    return {"op": "lrn", "size": size, "alpha": 2.0, "beta": 0.75, "k": 1.0}


# float32_tolerance's scale form (see backends.conformance.runner), k along the longest path here: a conv of 4
# channels 3x3 (+ 1 for the bias), the LRNs of 3 and 5 forward (n + 3 + FN) and backward (2n + 7 +
# 2 FN), the pool's 4 overlaps, dw's 2*8*8 sums; or the fused network's conv1 (3x3x3), LRN and conv2
# (9x3x3) forward, back through conv2's dx (7x3x3), the 2x2 pool, the LRN to conv1's dw
K = max(
    (4 * 9 + 1) + (3 + 3 + FN) + (5 + 3 + FN) + (2 * 3 + 7 + 2 * FN) + (2 * 5 + 7 + 2 * FN) + 4 + 2 * 8 * 8,
    (3 * 9 + 1) + (5 + 3 + FN) + (9 * 9 + 1) + 7 * 9 + 1 + (2 * 5 + 7 + 2 * FN) + 2 * 8 * 8,
)


def assert_close(got, ref):
    within_round_off(np.asarray(got), Expected(ref, K))


def reference(be, x, w, b, tail, g):
    """The unsharded block, through the plain layers: (y, dx, dw, db) for upstream gradient g."""
    conv = Conv2D(be, x.shape[1], w.shape[0], w.shape[2], 1, 1)
    conv.params.update(w=w, b=b)
    make = {
        "relu": lambda s: ReLU(be),
        "lrn": lambda s: LocalResponseNorm(be, s["size"], s["alpha"], s["beta"], s["k"]),
        "maxpool": lambda s: MaxPool2D(be, s["kernel"], s["stride"], s["padding"]),
    }
    layers = [conv] + [make[spec["op"]](spec) for spec in tail]
    y = x
    for layer in layers:
        y = layer.forward(y)
    if g is None:
        return y
    d = g
    for layer in reversed(layers):
        d = layer.backward(d)
    return y, d, conv.grads["w"], conv.grads["b"]


TAILS = [
    [],
    [RELU, POOL],
    [RELU, lrn(5), POOL],  # the paper's block
    [lrn(4)],  # an even window: 2 channels before, 1 after
    [lrn(3), RELU, lrn(5)],  # two cross-channel layers: the halos add up
]


@pytest.mark.parametrize("tail", TAILS, ids=lambda t: "+".join(s["op"] + str(s.get("size", "")) for s in t) or "none")
@pytest.mark.parametrize("counts", [[11], [5, 6], [1, 9, 1], [3, 0, 2, 6], [1, 1, 1, 8]])
def test_slices_with_halo_equal_the_whole_block(rng, tail, counts):
    be = NumpyBackend()
    total = sum(counts)
    x = rng.standard_normal((2, 3, 8, 8), dtype=np.float32)
    w = rng.standard_normal((total, 3, 3, 3), dtype=np.float32)
    b = rng.standard_normal(total, dtype=np.float32)
    y_ref = reference(be, x, w, b, tail, None)
    g = rng.standard_normal(y_ref.shape, dtype=np.float32)
    y_ref, dx_ref, dw_ref, db_ref = reference(be, x, w, b, tail, g)

    ys, dws, dbs, dx = [], [], [], np.zeros_like(x)
    for s, e in slices(counts):
        if s == e:
            continue
        h = halo_span(s, e, total, tail)
        y, cache = block_forward(be, x, w[h], b[h], 1, 1, tail, (s - h.start, e - h.start))
        ys.append(np.asarray(y))
        # the gradient of every kernel it computed: what the halo kernels get of it is dropped
        dx_k, dw_k, db_k = block_backward(be, np.ascontiguousarray(g[:, h]), cache, True)
        dws.append(dw_k)
        dbs.append(db_k)
        dx += dx_k
    assert_close(np.concatenate(ys, axis=1), y_ref)
    assert_close(np.concatenate(dws), dw_ref)
    assert_close(np.concatenate(dbs), db_ref)
    assert_close(dx, dx_ref)


@pytest.mark.parametrize("tail", TAILS, ids=lambda t: "+".join(s["op"] + str(s.get("size", "")) for s in t) or "none")
@pytest.mark.parametrize("channels", [[4], [1, 3], [2, 0, 2]])
def test_partial_convolutions_by_input_channels_summed_under_the_tails_equal_the_whole_block(rng, tail, channels):
    # by_channels.py's split: a partial convolution of each channel slice (no bias), summed on
    # each kernel slice's halo, where tail_forward runs; backward, the kernel
    # slices' conv-output gradients together go back through each partial: dx and dw of its channels
    be = NumpyBackend()
    x = rng.standard_normal((2, 4, 8, 8), dtype=np.float32)
    w = rng.standard_normal((11, 4, 3, 3), dtype=np.float32)
    b = rng.standard_normal(11, dtype=np.float32)
    y_ref = reference(be, x, w, b, tail, None)
    g = rng.standard_normal(y_ref.shape, dtype=np.float32)
    y_ref, dx_ref, dw_ref, db_ref = reference(be, x, w, b, tail, g)

    cspans = [(c0, c1) for c0, c1 in slices(channels) if c0 < c1]
    partials = [be.conv2d_partial(x[:, c0:c1], w[:, c0:c1], 1, 1) for c0, c1 in cspans]  # (11, 2, 8, 8) each
    ys, dycs = [], []
    for s, e in slices([2, 6, 3]):
        h = halo_span(s, e, 11, tail)
        conv_sum = np.empty((2, h.stop - h.start, 8, 8), np.float32)
        halo_sum(conv_sum, partials[0][0][h], [p[h] for p, _ in partials[1:]])
        conv_sum += b[h, None, None]
        y, cache = tail_forward(be, conv_sum, partials[0][1], tail, (s - h.start, e - h.start))
        ys.append(np.asarray(y))
        dycs.append(owned(be, tail_backward(be, np.ascontiguousarray(g[:, h]), cache), cache))
    assert_close(np.concatenate(ys, axis=1), y_ref)
    # joined kernel-major, as the split joins them for the conv backward: (N, 11, 8, 8) as a view
    dyc = np.concatenate([d.transpose(1, 0, 2, 3) for d in dycs]).transpose(1, 0, 2, 3)
    for (c0, c1), (_, conv_cache) in zip(cspans, partials, strict=True):
        dx, dw, db = be.conv2d_backward(dyc, conv_cache, True)
        assert_close(dx, dx_ref[:, c0:c1])
        assert_close(dw, dw_ref[:, c0:c1])
        assert_close(db, db_ref)


def test_halo_sizes():
    assert halo_width([]) == 0
    assert halo_width([RELU, lrn(5), POOL]) == 4  # 2 channels before, 2 after, once forward and once backward
    assert halo_width([lrn(4)]) == 3  # window [i - 2, i + 1]: backward reads [j - 1, j + 2]
    assert halo_width([lrn(3), RELU, lrn(5)]) == 6  # the halos of two cross-channel layers add up
    assert halo_span(0, 3, 10, [lrn(5)]) == slice(0, 7)
    assert halo_span(4, 6, 10, [lrn(5)]) == slice(0, 10)
    assert halo_span(4, 4, 10, [lrn(5)]) == slice(4, 4)  # no kernels, nothing computed


def test_a_gradient_that_does_not_cover_the_computed_kernels_is_refused(rng):
    be = NumpyBackend()
    x = rng.standard_normal((2, 3, 8, 8), dtype=np.float32)
    w = rng.standard_normal((9, 3, 3, 3), dtype=np.float32)
    _, cache = block_forward(be, x, w, np.zeros(9, np.float32), 1, 1, [lrn(5)], (4, 5))
    with pytest.raises(ValueError, match=r"over every computed kernel, \(2, 9, 8, 8\)"):
        block_backward(be, np.zeros((2, 3, 8, 8), np.float32), cache, True)


@pytest.mark.parametrize(
    "tail, complaint",
    [
        ({"op": "relu"}, "must be a list"),
        ([{"op": "softmax"}], "op one of"),
        ([{"op": "lrn", "size": 5}], "needs exactly the keys"),
        ([{"op": "maxpool", "kernel": 3, "stride": True, "padding": 1}], "stride must be an int"),
        ([{"op": "lrn", "size": 0, "alpha": 1.0, "beta": 0.75, "k": 2.0}], "1 <= size <= 64"),
        ([{"op": "maxpool", "kernel": 2, "stride": 2, "padding": 2}], "padding < kernel"),
        ([{"op": "bn", "eps": 1e-5, "training": 1}], "training must be a bool"),
        ([{"op": "bn", "eps": 0.0, "training": True}], "eps > 0"),
        ([{"op": "bn", "eps": 1e-5, "training": True}] * 2, "one bn at most"),
    ],
)
def test_bad_tails_are_refused_with_the_reason(tail, complaint):
    with pytest.raises(ValueError, match=complaint):
        check_tail(tail)


def test_tail_of_takes_the_per_channel_run_after_a_conv():
    be = NumpyBackend()
    net = paper_net("4:6", be)
    assert [s["op"] for s in tail_of(net.layers[1:])] == ["relu", "lrn", "maxpool"]
    batch = paper_net("4:6", be, norm="batch").layers[1:]
    assert tail_of(batch) == [RELU, {"op": "bn", "eps": 1e-5, "training": False}, POOL]
    assert tail_of(batch, training=True)[1]["training"] is True
    assert tail_of([BatchNorm2D(be, 6), BatchNorm2D(be, 6)]) == [bn(False)]  # one batch norm a tail: the second stays
    assert tail_of([]) == []


def bn(training: bool = True) -> dict:
    return {"op": "bn", "eps": 1e-5, "training": training}


BN_TAILS = [
    [RELU, bn(), POOL],  # the default preset's block
    [bn(), lrn(5)],  # a halo through the batch norm: its statistics are per kernel, so the halo's are exact too
    [lrn(3), RELU, bn()],
    [RELU, bn(False), POOL],  # evaluation: the running statistics
]
# K plus a batch norm's sums over its M = 2 x 8 x 8 values per kernel (the mean, the variance; dbeta, dgamma)
K_BN = K + 2 * (2 * 8 * 8 + 8)


def bn_reference(be, x, w, b, tail, g, gamma, beta, running):
    """The unsharded block with a batch norm of ``gamma``, ``beta``; ``running`` its (mean, var) before the step:
    (y, dx, dw, db, dgamma, dbeta, the batch's mean and unbiased variance, or the running ones in evaluation), each
    an Expected."""
    conv = Conv2D(be, x.shape[1], w.shape[0], w.shape[2], 1, 1)
    conv.params.update(w=w, b=b)
    norm = BatchNorm2D(be, w.shape[0], momentum=1.0)  # momentum 1: the running statistics it updates are the batch's
    norm.params.update(gamma=gamma, beta=beta)
    norm.buffers.update(running_mean=running[0].copy(), running_var=running[1].copy())
    make = {
        "relu": lambda s: ReLU(be),
        "lrn": lambda s: LocalResponseNorm(be, s["size"], s["alpha"], s["beta"], s["k"]),
        "maxpool": lambda s: MaxPool2D(be, s["kernel"], s["stride"], s["padding"]),
        "bn": lambda s: norm,
    }
    layers = [conv] + [make[spec["op"]](spec) for spec in tail]
    training = any(spec.get("training") for spec in tail)
    y = x
    for layer in layers:
        y = layer.forward(y, training)
    d = g
    for layer in reversed(layers[1:]):
        d = layer.backward(d)
    db = Expected(d.sum(axis=(0, 2, 3)), K_BN, np.abs(d).sum(axis=(0, 2, 3), dtype=np.float64))  # batch norm's
    d = conv.backward(d)  # dY_conv sums to 0 over a kernel: db is round-off, held to the rigorous form, over |terms|
    stats = [Expected(norm.buffers[name], K_BN) for name in ("running_mean", "running_var")]
    grads = [Expected(a, K_BN) for a in (d, conv.grads["w"], db.value, norm.grads["gamma"], norm.grads["beta"])]
    return [Expected(y, K_BN), *grads[:2], db, *grads[3:], *stats]


@pytest.mark.parametrize("tail", BN_TAILS, ids=lambda t: "+".join(s["op"] + str(s.get("training", "")) for s in t))
@pytest.mark.parametrize("counts", [[11], [5, 6], [1, 9, 1], [3, 0, 2, 6]])
def test_slices_with_batch_norm_equal_the_whole_block(rng, tail, counts):
    # each slice normalises its kernels (and halo) by their own batch statistics and gives back the batch mean and
    # variance of its kernels; backward, dgamma and dbeta of its own: the whole block's, slice by slice
    be = NumpyBackend()
    total, training = sum(counts), tail[[s["op"] for s in tail].index("bn")]["training"]
    x = rng.standard_normal((2, 3, 8, 8), dtype=np.float32)
    w = rng.standard_normal((total, 3, 3, 3), dtype=np.float32)
    b, gamma, beta, mean = rng.standard_normal((4, total), dtype=np.float32)
    var = rng.uniform(0.5, 2.0, total).astype(np.float32)
    conv_y = be.conv2d_forward(x, w, b, 1, 1)[0]
    shape = (2, total, *tail_output_hw(*conv_y.shape[2:], tail))
    g = rng.standard_normal(shape, dtype=np.float32)
    ref = bn_reference(be, x, w, b, tail, g, gamma, beta, (mean, var))

    got: dict[str, list] = {name: [] for name in ("y", "dw", "db", "dgamma", "dbeta", "mean", "var")}
    dx = np.zeros_like(x)
    for s, e in slices(counts):
        if s == e:
            continue
        h = halo_span(s, e, total, tail)
        norm = {"gamma": gamma[h], "beta": beta[h]} | (
            {} if training else {"running_mean": mean[h], "running_var": var[h]}
        )
        own = (s - h.start, e - h.start)
        y, cache = block_forward(be, x, w[h], b[h], 1, 1, tail, own, norm)
        got["y"].append(np.asarray(y))
        dx_k, dw_k, db_k = block_backward(be, np.ascontiguousarray(g[:, h]), cache, True)
        dx += dx_k
        for name, v in (("dw", dw_k), ("db", db_k), ("dgamma", cache.dnorm["gamma"]), ("dbeta", cache.dnorm["beta"])):
            got[name].append(v)
        if training:
            got["mean"].append(norm["mean"][own[0] : own[1]])
            got["var"].append(norm["var"][own[0] : own[1]])
    names = ("y", "dx", "dw", "db", "dgamma", "dbeta", "mean", "var")
    for name, r in zip(names, ref, strict=True):
        if name == "dx":
            within_round_off(dx, r, name)
        elif got[name]:
            within_round_off(np.concatenate(got[name], axis=int(name == "y")), r, name)
    assert all(got[name] for name in ("y", "dgamma", "dbeta")) and bool(got["mean"]) == training


def test_a_fused_network_gives_the_plain_numbers_and_detach_restores_it(rng):
    be = NumpyBackend()
    layers = [
        Conv2D(be, 3, 9, 3, 1, 1, need_dx=False, rng=rng),
        ReLU(be),
        LocalResponseNorm(be, alpha=1.0),
        MaxPool2D(be, 2, 2),
        Conv2D(be, 9, 7, 3, 1, 1, rng=rng),
        ReLU(be),
    ]
    for conv in (layers[0], layers[4]):
        conv.params["b"] = rng.standard_normal(conv.params["b"].shape, dtype=np.float32)
    net = Network(be, list(layers))
    x = rng.standard_normal((2, 3, 8, 8), dtype=np.float32)
    y_ref = net.forward(x)
    g = rng.standard_normal(y_ref.shape, dtype=np.float32)
    net.backward(g)
    ref = [np.copy(layer.grads[k]) for layer in (layers[0], layers[4]) for k in ("w", "b")]
    keys = [key for key, _, _ in net.named_params()]

    transport = InprocTransport(lambda i: Worker(NumpyBackend()), protocol=VERSION)
    try:
        cluster = Cluster(transport, transport.start(2, timeout=TIMEOUT), be, recv_timeout=TIMEOUT)
        cluster.attach(net)
        # each conv and the ReLU / LRN / pool after it became one sharded block in the list
        assert [type(layer) for layer in net.layers] == [ShardedBlock, ShardedBlock]
        assert net.layers[0].layers == layers[:4] and net.layers[1].layers == layers[4:]
        assert [key for key, _, _ in net.named_params()] == keys  # the same names, the same arrays
        assert all(net.layers[i].params is layers[j].params for i, j in ((0, 0), (1, 4)))
        cluster.set_plan("conv1", [2, 1, 6])
        cluster.set_plan("conv2", [0, 4, 3])
        for _ in range(2):
            assert_close(net.forward(x), y_ref)
            net.backward(g)
            got = [layer.grads[k] for layer in (layers[0], layers[4]) for k in ("w", "b")]
            for a, r in zip(got, ref, strict=True):
                assert_close(a, r)
            # each worker got its slice plus the halo, and returned only its own channels
            assert cluster.last_step["shares"] == {"conv1": [2, 1, 6], "conv2": [0, 4, 3]}
        cluster.detach(net)
        assert net.layers == layers
        assert_close(net.forward(x), y_ref)
    finally:
        transport.close()


@pytest.mark.parametrize(("split", "pipeline"), [("kernels", 32), ("channels", 32), ("channels", 3)])
def test_a_fused_network_with_batch_norm_trains_as_the_plain_one(rng, split, pipeline):
    # the default preset's blocks, conv -> ReLU -> batch norm -> pool, on two workers and the master: two SGD steps
    # give the plain network's losses, parameters and running statistics, and evaluation its logits; split by
    # input channels in chunks of images too, the batch norm's tail going once, over the whole batch
    be = NumpyBackend()
    x = rng.standard_normal((4, 3, 16, 16), dtype=np.float32)
    labels = rng.integers(0, 10, 4)
    ref, net = (paper_net("6:9", be, norm="batch", seed=3, image_size=16) for _ in range(2))
    transport = InprocTransport(lambda i: Worker(NumpyBackend()), protocol=VERSION)
    try:
        workers = transport.start(2, timeout=TIMEOUT)
        cluster = Cluster(transport, workers, be, recv_timeout=TIMEOUT, split=split, pipeline=pipeline)
        cluster.attach(net)
        assert [len(layer.layers) for layer in net.layers[:2]] == [4, 4]  # each conv with its ReLU, norm and pool
        assert [key for key, _, _ in net.named_params()] == [key for key, _, _ in ref.named_params()]
        cluster.set_plan("conv1", [2, 1, 3])
        cluster.set_plan("conv2", [3, 4, 2])
        optimisers = [SGD(n, lr=0.1, momentum=0.9) for n in (ref, net)]
        for _ in range(2):
            losses = [n.train_step(x, labels) for n in (ref, net)]
            for opt in optimisers:
                opt.step()
            cluster.step += 1
            assert losses[1] == pytest.approx(losses[0], rel=1e-5)
        state, want = net.state_dict(), ref.state_dict()
        assert state.keys() == want.keys() and any("running_var" in key for key in state)
        for key in want:
            within_round_off(state[key], Expected(want[key], K_BN), key)
        within_round_off(net.forward(x), Expected(ref.forward(x), K_BN), "eval logits")
    finally:
        transport.close()
