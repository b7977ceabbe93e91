"""The `tinyconv` command: dispatch, help, and a device listing that never tracebacks."""

from __future__ import annotations

import pytest

from tinyconv.cli import main


def test_help_lists_every_command(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in ("worker", "devices", "conformance", "plot"):
        assert command in out


def test_no_command_and_unknown_command_are_usage_errors(capsys):
    assert main([]) == 2
    assert main(["train-everything"]) == 2
    assert "unknown command 'train-everything'" in capsys.readouterr().err


def test_devices_lists_backends_and_opencl(capsys):
    assert main(["devices"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("backends:") and "numpy" in out and "opencl" in out
    assert "OpenCL" in out or "--device P:D" in out  # either the devices or why there are none


def test_conformance_dispatches_to_the_suite(capsys):
    assert main(["conformance", "--backend", "numpy"]) == 0
    assert "0 failed" in capsys.readouterr().out


def test_conformance_on_a_chosen_device(capsys):
    # what a GPU user runs first: the suite on the device they name, as `tinyconv devices` lists it
    assert main(["conformance", "--backend", "opencl", "--device", "0:0"]) == 0
    out = capsys.readouterr().out
    assert "0 failed" in out and "OpenCLBackend" in out
    assert main(["conformance", "--backend", "opencl", "--device", "9:9"]) == 1
    assert "no OpenCL device '9:9'" in capsys.readouterr().err
    assert main(["conformance", "--backend", "numpy", "--device", "0"]) == 1
    assert "the numpy backend has no devices to choose from" in capsys.readouterr().err


def test_every_subcommand_help_is_its_own(capsys):
    # `tinyconv X --help` shows X's usage under the name the user typed, and does not run X
    for command in ("conformance", "devices", "comm", "keygen", "plot"):
        try:
            main([command, "--help"])
        except SystemExit as e:  # argparse exits 0 after printing help
            assert e.code == 0
        out = capsys.readouterr().out
        assert out.startswith(f"usage: tinyconv {command}"), (command, out[:80])
        assert "pthread" not in out and "backends:" not in out  # devices --help lists no devices


def test_version(capsys):
    from importlib.metadata import version

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"tinyconv {version('tinyconv')}"


@pytest.mark.parametrize(("typed", "meant"), [("trian", "train"), ("simulte", "simulate"), ("wroker", "worker")])
def test_an_unknown_command_gets_the_nearest_as_a_suggestion(capsys, typed, meant):
    assert main([typed]) == 2
    assert f"unknown command {typed!r}; did you mean `tinyconv {meant}`?" in capsys.readouterr().err
