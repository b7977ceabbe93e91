"""tinyconv comm: the paper's eq. 2 and the bytes of tinyconv's paper split, against a real step."""

from __future__ import annotations

import pytest

from tinyconv.lab.eq2 import (
    F32,
    F64,
    build_parser,
    conv_shapes,
    eq2_bytes,
    equal_counts,
    kernel_split_bytes,
    main,
    measure,
    paper_split_bytes,
    split_bytes,
)
from tinyconv.model import paper_net


def test_eq2_by_hand_for_the_paper_net():
    convs = conv_shapes(paper_net("4:6"), batch=2)
    assert [(c.x, c.w, c.y, c.need_dx) for c in convs] == [
        ((2, 3, 32, 32), (4, 3, 5, 5), (2, 4, 32, 32), False),
        ((2, 4, 16, 16), (6, 4, 5, 5), (2, 6, 16, 16), True),
    ]
    counts = [[1, 3], [2, 4]]  # the master's share first: it moves nothing
    conv1 = 32 * 32 * 3 * 2 + 5 * 5 * 3 * 3 + 32 * 32 * 3 * 2  # in^2 inCh batch + k^2 numK inCh + out^2 numK batch
    conv2 = 16 * 16 * 4 * 2 + 5 * 5 * 4 * 4 + 16 * 16 * 4 * 2
    assert eq2_bytes(convs, counts) == (conv1 + conv2) * F64
    assert eq2_bytes(convs, counts, F32) == (conv1 + conv2) * F32
    # two workers with kernels: the input goes to each
    assert eq2_bytes(convs, [[0, 2, 2], [0, 3, 3]]) - eq2_bytes(convs, [[0, 0, 4], [0, 0, 6]]) == (
        (32 * 32 * 3 * 2 + 16 * 16 * 4 * 2) * F64
    )
    assert eq2_bytes(convs, [[4], [6]]) == 0 and paper_split_bytes(convs, [[4], [6]]) == (0, 0)  # the master alone


@pytest.mark.parametrize("split", ["kernels", "channels"])
@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("arch, batch, participants", [("4:8", 3, 2), ("12:20", 2, 3), ("2:3", 2, 4)])
def test_the_model_is_what_a_step_moves(arch, batch, participants, fuse, split):
    # 12:20 among 3: fused, the LRN halo widens each worker's kernels and the partial sums it needs;
    # 2:3 among 4: some participants get no kernels of a layer, and conv2 has too few input channels
    # to go by them
    convs = conv_shapes(paper_net(arch), batch)
    counts = equal_counts(convs, participants)
    assert measure(arch, batch, participants, fuse=fuse, split=split) == split_bytes(convs, counts, fuse, split)
    if split == "kernels":
        assert split_bytes(convs, counts, fuse, split) == kernel_split_bytes(convs, counts, fuse)


def test_fused_tails_move_the_halo_and_return_pooled_maps():
    convs = conv_shapes(paper_net("12:20"), batch=2)
    counts = [[4, 4, 4], [7, 7, 6]]
    fused, paper = kernel_split_bytes(convs, counts, True), paper_split_bytes(convs, counts)
    assert fused[1] < paper[1]  # pooled maps back: a quarter of the conv's
    # conv1's 12 kernels, 4 each: worker0 owns [4, 8) and computes [0, 12), LRN's halo of 4 on each
    # side; worker1 owns [8, 12) and computes [4, 12)
    conv1 = convs[0]
    x, kernel, maps, pooled = 2 * 3 * 32 * 32 * F32, 3 * 25 * F32, 2 * 32 * 32 * F32, 2 * 16 * 16 * F32
    computed, own = 12 + 8, 4 + 4
    fused_back = own * pooled + own * (kernel + F32)  # conv1 needs no dx
    assert kernel_split_bytes([conv1], [[4, 4, 4]], True) == (2 * x + computed * (kernel + F32 + pooled), fused_back)
    paper_back = own * maps + own * (kernel + F32)
    assert paper_split_bytes([conv1], [[4, 4, 4]]) == (2 * x + own * (kernel + F32 + maps), paper_back)


def test_the_command_prints_the_table_and_checks_itself(capsys):
    assert main(["--arch", "4:8", "--batch-size", "2", "--workers", "0", "1", "2", "--run-step"]) == 0
    out = capsys.readouterr().out
    assert "eq. 2 (doubles)" in out and "--split channels (fused)" in out and "measured" in out
    assert "differs" not in out
    rows = [line.split("|") for line in out.splitlines() if line.startswith("| ") and "participants" not in line]
    assert sorted({r[1].strip() for r in rows}) == ["1", "2", "3"]  # participants = workers + 1


def test_run_step_counts_what_a_real_step_moves_on_a_tiny_case(capsys):
    """One worker beside the master, 2:3 at batch size 1, bf16: each split's step run, its bytes the model's."""
    assert main(["--arch", "2:3", "--batch-size", "1", "--workers", "1", "--run-step", "--wire-precision", "bf16"]) == 0
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in capsys.readouterr().out.splitlines()]
    rows = [r for r in rows if r and r[0] == "2"]  # 2 participants: the master and its worker
    assert len(rows) == 3 and all(r[2] == "bf16" and r[-1] == r[5] for r in rows)  # measured == the model's


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--arch", "4:8", "--batch-size", "0"], "--batch-size: must be 1 or more"),
        (["--arch", "nope"], "is not C1:C2"),
        (["--batch", "2"], "--batch is now --batch-size"),
        (["--participants", "2"], "--participants is now --workers (workers beside the master: --participants 3"),
        (["--measure"], "--measure is now --run-step"),
        (["--workers", "-1"], "must be 0 or more"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, argv, says):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and says in err


def test_print_config_round_trips_through_config(tmp_path, capsys):
    assert main(["--arch", "4:8", "--workers", "0", "2", "--run-step", "--print-config"]) == 0
    text = capsys.readouterr().out
    assert "workers = [0, 2]" in text and "run-step = true" in text
    (tmp_path / "comm.toml").write_text(text)
    again = build_parser().parse_args(["--config", str(tmp_path / "comm.toml")])
    assert (again.arch, again.workers, again.run_step, again.batch_size) == ("4:8", [0, 2], True, 64)
