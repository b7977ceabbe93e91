"""What one training step moves between the master and its workers: the paper's eq. 2, and tinyconv's.

    tinyconv comm --arch 300:1000 --batch-size 64 --workers 1 2 3 --run-step

Marques et al.'s eq. 2 counts, for every convolutional layer, its input maps, its kernels and its
output maps, in doubles (8 bytes):

    eq. 2 = 8 * sum over conv layers of  (in^2 * inCh * batch  +  k^2 * numK * inCh  +  out^2 * numK * batch)

Read for a split across P participants (the master among them, as tinyconv runs it), the input goes
to every worker that has kernels (one message each, as over MPI or ZeroMQ), and the kernels and
output maps of the workers' share once; the master's own share moves nothing. That is the forward
pass only. tinyconv's paper split (``--fuse off --split kernels``) also moves the backward, in
float32 (4 bytes), per worker with k of a layer's kernels:

    forward   to the worker: x, its k kernels and k biases     back: its k output maps
    backward  to the worker: the gradient of those k maps      back: dW and db of its k kernels, and
                                                                      a whole partial dX (not for the
                                                                      first layer, which needs none)

With the tails fused (``--fuse on --split kernels``) a worker also runs the ReLU / LRN / batch norm / max pool
after the convolution on its kernels and their halo (the neighbours LRN's window reads): it gets
the weights and the gradient of the kernels it computes, and returns pooled maps, a quarter of the
size. :func:`kernel_split_bytes` counts both; ``--run-step`` runs one step of each with in-process
workers and reads the bytes the step's metrics recorded (array bytes, as every transport counts
them), which must agree exactly.

Split by input channels (``--split channels``, conv2's default with workers on the master's
machine), a worker gets x and w of its channels only, but the partial sums of all the kernels
cross the wire: :func:`channel_split_bytes` counts its two rounds each way.

``--wire-precision`` counts the words the arrays travel in (``tinyconv/distributed/wire_precision.py``):
bf16 and fp16 2 bytes, adt24 3, s8 1 and a 4-byte scale per plane (each image's and channel's map,
each kernel's K x K weights of one input channel, a whole bias vector), per role -- weights, maps,
gradients (``adaptive_precision.py``). So the terms below count each array by its shape
(``wire_precision.nbytes_of``), not only by its size. ``adaptive`` has two rows: AWP's start
(weights bf16) and its end (weights fp32), the maps s8 and the gradients bf16 in both. Beside
eq. 2 the table gives the ratio of tinyconv's forward bytes to it (eq. 2's own scope) and of its
whole step's.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from tinyconv.distributed.adaptive_precision import ROLES
from tinyconv.distributed.conv_shapes import ConvShape, conv_shapes
from tinyconv.distributed.shard.balance import apportion
from tinyconv.distributed.shard.block import tail_output_hw
from tinyconv.distributed.shard.plan import Plan
from tinyconv.distributed.wire_precision import nbytes_of
from tinyconv.model import paper_net
from tinyconv.options import Parser, UsageError, add, add_config, config_text
from tinyconv.report import format_table

F32, F64 = 4, 8  # bytes per float
FP32_WORDS = dict.fromkeys(ROLES, "fp32")  # role (weights, maps, grads) -> its wire format
# the splits the table shows: (label, fuse, split), as the main job's --fuse and --split
SPLITS = (
    ("paper: --fuse off --split kernels", False, "kernels"),
    ("--split kernels (fused)", True, "kernels"),
    ("--split channels (fused)", True, "channels"),
)


def equal_counts(convs: Sequence[ConvShape], participants: int) -> list[list[int]]:
    """Each layer's kernels split equally among ``participants`` (the master first), as an uncalibrated
    cluster splits them."""
    return [apportion([1.0] * participants, conv.w[0]) for conv in convs]


def _plan(counts: Sequence[int], tail: list[dict[str, Any]], channel_counts: Sequence[int] | None = None) -> Plan:
    """The plan a cluster of the master and len(counts) - 1 workers makes for one layer."""
    placement = [("master", None)] + [(f"worker{i}", i) for i in range(len(counts) - 1)]
    return Plan.of(placement, counts, tail, channel_counts)


def eq2_bytes(convs: Sequence[ConvShape], counts: Sequence[Sequence[int]], word: int = F64) -> int:
    """The paper's eq. 2 for a step whose layers are split by ``counts`` (the master's first, moving
    nothing), in words of ``word`` bytes."""
    total = 0
    for conv, layer_counts in zip(convs, counts, strict=True):
        n, c, h, w = conv.x
        _, _, k, _ = conv.w
        oh, ow = conv.y[2:]
        workers = [kk for kk in layer_counts[1:] if kk]
        total += len(workers) * h * w * c * n + k * k * sum(workers) * c + oh * ow * sum(workers) * n
    return total * word


def block_bytes(
    conv: ConvShape, computed: int, own: int, tail: Sequence[dict[str, Any]] = (), words: dict[str, str] = FP32_WORDS
) -> tuple[int, int, int, int]:
    """One worker's bytes in one step split by kernels, as (forward to it, forward back, backward to
    it, backward back): it computes ``computed`` kernels (its ``own`` and their halo) and runs
    ``tail`` after them (empty: the paper's split), each array in its role's format in ``words``
    (role -> format; float32 by default), counted by its shape (s8 adds a scale per plane)::

        forward   x (N, C, H, W), w (computed, C, K, K), b (computed,)  ->  y (N, own, OH', OW')
        backward  dy (N, computed, OH', OW')  ->  dw (own, C, K, K), db (own,), dx (N, C, H, W) if needed
    """
    wt, mp, gr = words["weights"], words["maps"], words["grads"]
    n, kernel = conv.x[0], conv.w[1:]
    hw = tail_output_hw(*conv.y[2:], list(tail))  # one kernel's (tail's) map of one image
    to_f = nbytes_of(conv.x, mp) + nbytes_of((computed, *kernel), wt) + nbytes_of((computed,), wt)
    back_f = nbytes_of((n, own, *hw), mp)
    to_b = nbytes_of((n, computed, *hw), gr)
    back_b = nbytes_of((own, *kernel), gr) + nbytes_of((own,), gr) + (nbytes_of(conv.x, gr) if conv.need_dx else 0)
    return to_f, back_f, to_b, back_b


def kernel_split_bytes(
    convs: Sequence[ConvShape],
    counts: Sequence[Sequence[int]],
    fuse: bool = False,
    words: dict[str, str] = FP32_WORDS,
    forward_only: bool = False,
) -> tuple[int, int]:
    """(to the workers, from the workers) in one step split by kernels, array bytes in ``words`` (role
    -> wire format; float32 by default): the paper's split, or with ``fuse`` tinyconv's, where each
    worker also runs the conv's tail on its kernels and their halo (the kernels LRN's window reads,
    ``plan.py``) and returns the tail's smaller maps. ``forward_only``: the forward's bytes alone.
    Each worker's terms: :func:`block_bytes`."""
    to = back = 0
    for conv, layer_counts in zip(convs, counts, strict=True):
        tail = list(conv.tail) if fuse else []
        for p in _plan(layer_counts, tail).workers:
            to_f, back_f, to_b, back_b = block_bytes(conv, p.halo.stop - p.halo.start, p.n_kernels, tail, words)
            to, back = to + to_f, back + back_f
            if not forward_only:
                to, back = to + to_b, back + back_b
    return to, back


def channel_split_bytes(
    conv: ConvShape,
    counts: Sequence[int],
    fuse: bool = True,
    words: dict[str, str] = FP32_WORDS,
    forward_only: bool = False,
) -> tuple[int, int]:
    """(to the workers, from the workers) for one layer split by input channels (``by_channels.py``),
    its channels in proportion to the kernels, in one step: two rounds each way (``words`` and
    ``forward_only`` as :func:`kernel_split_bytes`'; the arrays' shapes are ``protocol.py``'s)."""
    n, c, h, w = conv.x
    f, _, k, _ = conv.w
    wt, mp, gr = words["weights"], words["maps"], words["grads"]
    tail = list(conv.tail) if fuse else []
    active = _plan(counts, tail, apportion([float(kk) for kk in counts], c)).active
    chw = conv.y[2:]  # one kernel's conv output of one image
    thw = tail_output_hw(*chw, tail)  # one kernel's tail output of one image

    def maps(kernels: int, hw: tuple[int, ...], fmt: str) -> int:  # (N, kernels, *hw), absent when empty
        return nbytes_of((n, kernels, *hw), fmt) if kernels else 0

    to = back = 0
    for i, p in enumerate(active):
        if p.worker is None:
            continue
        width = p.channels.stop - p.channels.start
        x_part, w_part = (n, width, h, w), (f, width, k, k)  # x and w of its channels
        halo = p.halo.stop - p.halo.start
        lo_end = max((q.halo.stop for q in active[:i]), default=0)  # what the others' halos need of its partial
        hi_start = min((q.halo.start for q in active[i + 1 :]), default=f)
        to += nbytes_of(x_part, mp) + nbytes_of(w_part, wt)  # partial_forward
        back += maps(lo_end, chw, mp) + maps(f - hi_start, chw, mp)  # p_lo, p_hi
        to += nbytes_of((halo,), wt) + (maps(halo, chw, mp) if len(active) > 1 else 0)  # tail_forward: b, the sum
        back += maps(p.n_kernels, thw, mp)  # y of its kernels
        if forward_only:
            continue
        to += maps(halo, thw, gr)  # tail_backward: dy over its halo
        back += maps(p.n_kernels, chw, gr)  # dyc, its kernels' conv-output gradient
        to += maps(f - p.n_kernels, chw, gr)  # partial_backward: the others' dyc (dyc_lo and dyc_hi: the same planes)
        back += (nbytes_of(x_part, gr) if conv.need_dx else 0) + nbytes_of(w_part, gr) + nbytes_of((f,), gr)
    return to, back


def split_bytes(
    convs: Sequence[ConvShape],
    counts: Sequence[Sequence[int]],
    fuse: bool = True,
    split: str = "kernels",
    words: dict[str, str] = FP32_WORDS,
    forward_only: bool = False,
) -> tuple[int, int]:
    """(to, from) the workers in one step of tinyconv's split: ``split`` "kernels" for every layer, or
    "channels" for the layers that go by input channels (those that need dX and have a channel and a
    kernel for every participant, as ``Cluster`` decides), by kernels for the others; ``words`` and
    ``forward_only`` as :func:`kernel_split_bytes`'."""
    to = back = 0
    for conv, layer_counts in zip(convs, counts, strict=True):
        by_channels = split == "channels" and conv.need_dx and min(conv.x[1], conv.w[0]) >= len(layer_counts)
        if by_channels and any(layer_counts[1:]):
            t, b = channel_split_bytes(conv, layer_counts, fuse, words, forward_only)
        else:
            t, b = kernel_split_bytes([conv], [layer_counts], fuse, words, forward_only)
        to, back = to + t, back + b
    return to, back


def wire_words(setting: str) -> list[tuple[str, dict[str, str]]]:
    """The format of each role under ``--wire-precision setting``, as (label, words) rows: one for a
    fixed format, AWP's start and end for "adaptive"."""
    from tinyconv.distributed.adaptive_precision import AdaptivePrecision

    if setting != "adaptive":
        return [(setting, dict.fromkeys(ROLES, setting))]
    awp = AdaptivePrecision()
    ends = (("adaptive (start)", awp.ladder[0]), ("adaptive (settled)", awp.ladder[-1]))
    return [(label, {"weights": w, "maps": awp.maps, "grads": awp.grads}) for label, w in ends]


def paper_split_bytes(convs: Sequence[ConvShape], counts: Sequence[Sequence[int]]) -> tuple[int, int]:
    """(to the workers, from the workers) in one step of the paper's split (``--fuse off --split kernels``)."""
    return kernel_split_bytes(convs, counts, fuse=False)


def measure(
    arch: str,
    batch: int,
    participants: int,
    image_size: int = 32,
    fuse: bool = False,
    split: str = "kernels",
    wire_precision: str = "fp32",
) -> tuple[int, int]:
    """The bytes one real training step moves (``fuse``, ``split`` and ``wire_precision`` as the main
    job's options): the master and ``participants`` - 1 in-process workers, an equal split, random images."""
    from tinyconv.distributed.pool import distribute

    net = paper_net(arch, "numpy", image_size=image_size)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, 3, image_size, image_size), dtype=np.float32)
    y = rng.integers(0, 10, batch)
    with distribute(
        net,
        "inproc",
        participants - 1,
        split=split,
        fuse=fuse,
        calibrate=False,
        rebalance=False,
        batch_size=batch,
        image_size=image_size,
        announce=lambda _: None,
        wire_precision=wire_precision,
    ) as cluster:
        net.train_step(x, y)
        step = cluster.last_step
    return step["bytes_sent"], step["bytes_recv"]


def mb(n: int) -> str:
    return f"{n / 1e6:.2f}"


def rows_for(args: argparse.Namespace, convs: Sequence[ConvShape], n: int) -> list[tuple[list[str], Any, Any]]:
    """The table's rows for ``n`` participants: (row, the model's bytes, the measured ones or None)."""
    counts = equal_counts(convs, n)
    eq2_doubles = eq2_bytes(convs, counts)
    eq2 = [mb(eq2_doubles), mb(eq2_bytes(convs, counts, F32))]
    out = []
    for label, fuse, split in SPLITS if n > 1 else SPLITS[:1]:  # the master alone moves nothing
        for setting in args.wire_precision:
            for wire, words in wire_words(setting):
                model = split_bytes(convs, counts, fuse, split, words)
                forward = sum(split_bytes(convs, counts, fuse, split, words, forward_only=True))
                paper = split == "kernels" and not fuse
                ratios = [f"{100 * b / eq2_doubles:.2f} %" if eq2_doubles else "" for b in (forward, sum(model))]
                row = [str(n), label, wire, *(eq2 if paper else ["", ""]), f"{mb(model[0])} / {mb(model[1])}"]
                row += ratios
                got = None
                if args.run_step and wire == "adaptive (settled)":
                    row.append("-")  # a real step runs at AWP's start
                elif args.run_step:
                    got = (0, 0)  # the master alone moves nothing
                    if n > 1:
                        got = measure(args.arch, args.batch_size, n, fuse=fuse, split=split, wire_precision=setting)
                    row.append(f"{mb(got[0])} / {mb(got[1])}" + ("" if got == model else " (differs)"))
                out.append((row, model, got))
    return out


def build_parser() -> Parser:
    p = Parser(
        prog="tinyconv comm",
        description="Bytes one training step moves: the paper's eq. 2 (forward, doubles and float32) beside "
        "tinyconv's splits -- the paper's (--fuse off --split kernels), with the tails fused, and by input "
        "channels -- forward and backward, for an equal split among the master and its workers, in the words "
        "of each --wire-precision; the last two columns are tinyconv's forward bytes and its whole step's "
        "over eq. 2 in doubles. --run-step checks each model against one real step. A bad option is one line "
        "on stderr and exit 2.",
    )
    add(p, "arch", "batch_size", defaults={"arch": "50:500", "batch_size": 64})
    add(
        p,
        "workers",
        "wire_precision",
        many=("workers", "wire_precision"),
        defaults={"workers": [1, 2, 3], "wire_precision": ["fp32"]},
        helps={
            "workers": "a table row for each count; participants = workers + 1",
            "wire_precision": "adaptive shows AWP's start (weights bf16) and its settled end (weights fp32), the "
            "maps s8 and the gradients bf16 in both",
        },
    )
    p.add_argument(
        "--run-step",
        action="store_true",
        help="also run one step per count, split and format with in-process workers (numpy) and show "
        "its bytes (adaptive: its start)",
    )
    add_config(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``tinyconv comm ARGS``: 0 when every step run agrees with its model, 1 when one differs, 2 on bad input."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if "--measure" in argv:  # one meaning: tinyconv simulate --measure times this machine
            raise UsageError(
                "--measure is now --run-step: also run one step and count its bytes (see tinyconv comm --help)"
            )
        args = build_parser().parse_args(argv)
        if args.print_config:
            print(config_text(vars(args)))
            return 0
        convs = conv_shapes(paper_net(args.arch, "numpy"), args.batch_size)
    except (UsageError, ValueError) as e:
        print(f"tinyconv comm: error: {e}", file=sys.stderr)
        return 2
    header = ["participants", "split", "wire", "eq. 2 (doubles)", "eq. 2 (float32)", "model: to / from workers"]
    header += ["forward / eq. 2", "step / eq. 2"] + (["measured"] if args.run_step else [])
    rows, agree = [], True
    for n in (w + 1 for w in args.workers):
        for row, model, got in rows_for(args, convs, n):
            agree &= got is None or got == model
            rows.append(row)
    print(
        f"{args.arch} at batch size {args.batch_size}, kernels split equally (the master first, moving nothing); "
        "MB per step: the paper's eq. 2 (forward), and to / from the workers (forward and backward) in each split"
    )
    print(format_table(header, rows))
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
