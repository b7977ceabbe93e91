"""`tinyconv plot`'s bad input: one line on stderr naming what was wrong, exit 2, and no chart written."""

from __future__ import annotations

import json

import pytest

from tinyconv.lab.plot import main


def _refused(capsys, argv: list[str], message: str) -> None:
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and message in err, (out, err)


def test_a_run_without_steps_draws_no_empty_chart(tmp_path, capsys):
    run = tmp_path / "run.jsonl"
    run.write_text(json.dumps({"event": "run", "seed": 0}) + "\n")
    _refused(capsys, [str(run), "-o", str(tmp_path / "out")], "has no step records")
    assert not list((tmp_path / "out").glob("*.svg"))


def test_an_output_that_is_a_file_blames_the_output_not_the_input(tmp_path, capsys):
    run, taken = tmp_path / "run.jsonl", tmp_path / "taken"
    run.write_text(json.dumps({"event": "step", "step": 1, "loss": 2.0}) + "\n")
    taken.write_text("not a folder")
    _refused(capsys, [str(run), "-o", str(taken)], f"--out {taken} is a file: give a folder")


@pytest.mark.parametrize("name", ["missing.jsonl", "."])
def test_an_input_that_is_no_file_is_named(tmp_path, capsys, name):
    path = tmp_path / name
    _refused(capsys, [str(path), "-o", str(tmp_path / "out")], f"{path}: ")


def test_a_bad_option_is_one_line(capsys):
    _refused(capsys, ["--no-such-option", "x.jsonl"], "unrecognized arguments: --no-such-option")
