"""tinyconv comm: the paper's eq. 2 and the bytes of tinyconv's paper split, against a real step."""

from __future__ import annotations

import pytest

from tinyconv.comm import F32, F64, conv_shapes, eq2_bytes, equal_counts, main, measure, paper_split_bytes
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


@pytest.mark.parametrize("arch, batch, participants", [("4:8", 3, 2), ("5:7", 2, 3), ("2:3", 2, 4)])
def test_the_model_is_what_a_step_of_the_paper_split_moves(arch, batch, participants):
    # 2:3 among 4: some participants get no kernels of a layer, and move nothing for it
    convs = conv_shapes(paper_net(arch), batch)
    counts = equal_counts(convs, participants)
    assert measure(arch, batch, participants) == paper_split_bytes(convs, counts)


def test_the_command_prints_the_table_and_checks_itself(capsys):
    assert main(["--arch", "4:8", "--batch", "2", "--participants", "1", "2", "3", "--measure"]) == 0
    out = capsys.readouterr().out
    assert "eq. 2 MB (doubles)" in out and "measured MB" in out and "differs" not in out
    with pytest.raises(SystemExit):
        main(["--arch", "4:8", "--batch", "0"])
    with pytest.raises(SystemExit):
        main(["--arch", "nope"])
