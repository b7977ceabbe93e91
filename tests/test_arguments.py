"""The main job's bad inputs: each is one line on stderr and exit 2, before any work starts.

Every case runs ``main([...])`` in this process: nothing is trained, no worker started, no data
loaded -- which the empty stdout shows (the network is printed only once the checks pass).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from tinyconv.checkpoint import save_checkpoint
from tinyconv.commands import train, train_checks
from tinyconv.data import synthetic_dataset
from tinyconv.model import paper_net
from tinyconv.trainer import TrainConfig, Trainer

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "cifar10_dist.py"
BASE = ["--dataset", "synthetic", "--no-progress", "--arch", "4:8", "--batch-size", "32"]


@pytest.fixture(scope="module")
def example():
    """The main job's entry point, tinyconv/commands/train.py (examples/cifar10_dist.py and `tinyconv train` run it)."""
    return train


def refused(example, capsys, args: list[str], message: str) -> str:
    """Run the main job with ``args``; it must exit 2 with one line holding ``message`` and do nothing else."""
    code = example.main([*BASE, *args])
    out, err = capsys.readouterr()
    assert code == 2, err
    assert out == "", "the run went past the checks"
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    assert message in err, err
    return err


# ---- numbers ---------------------------------------------------------------------------------------
NUMBERS = [
    (["--batch-size", "0"], "argument --batch-size: must be 1 or more, got 0"),
    (["--batch-size", "-5"], "argument --batch-size: must be 1 or more, got -5"),
    (["--batch-size", "abc"], "argument --batch-size: 'abc' is not a whole number"),
    (["--steps", "0"], "argument --steps: must be 1 or more, got 0"),
    (["--epochs", "0"], "argument --epochs: must be 1 or more, got 0"),
    (["--epochs", "-2"], "argument --epochs: must be 1 or more, got -2"),
    (["--lr", "0"], "argument --lr: must be a number > 0, got 0"),
    (["--lr", "-0.1"], "argument --lr: must be a number > 0, got -0.1"),
    (["--lr", "nan"], "argument --lr: must be a number > 0, got nan"),
    (["--lr", "inf"], "argument --lr: must be a number > 0, got inf"),
    (["--momentum", "1"], "argument --momentum: must be a fraction in [0, 1), got 1"),
    (["--momentum", "1.5"], "argument --momentum: must be a fraction in [0, 1), got 1.5"),
    (["--momentum", "-0.1"], "argument --momentum: must be a fraction in [0, 1), got -0.1"),
    (["--warmup-epochs", "-1"], "argument --warmup-epochs: must be a number >= 0, got -1"),
    (["--warmup", "-0.1"], "argument --warmup: must be a fraction in [0, 1), got -0.1"),
    (["--warmup", "1"], "argument --warmup: must be a fraction in [0, 1), got 1"),
    (["--warmup", "nan"], "argument --warmup: must be a fraction in [0, 1), got nan"),
    (["--warmup", "0.1", "--warmup-epochs", "1"], "--warmup and --warmup-epochs both set the warm-up: give one"),
    (["--weight-decay=-1e-4"], "argument --weight-decay: must be a number >= 0, got -1e-4"),
    (["--conv1", "0"], "argument --conv1: must be 1 or more, got 0"),
    (["--conv2", "-3"], "argument --conv2: must be 1 or more, got -3"),
    (["--workers", "-1"], "argument --workers: must be 0 or more, got -1"),
    (["--threads", "0"], "argument --threads: must be 1 or more, got 0"),
    (["--start-timeout", "0"], "argument --start-timeout: must be a number > 0, got 0"),
    (["--rebalance-threshold", "-0.1"], "argument --rebalance-threshold: must be a number > 0, got -0.1"),
    (["--checkpoint-every", "0"], "argument --checkpoint-every: must be 1 or more, got 0"),
    (["--checkpoint-minutes", "0"], "argument --checkpoint-minutes: must be a number > 0, got 0"),
    (["--norm", "group"], "argument --norm: must be one of lrn, batch, none, got 'group'"),
    (["--plan", "sometimes"], "argument --plan: invalid choice: 'sometimes'"),
    (["--no-such-option"], "unrecognized arguments: --no-such-option"),
]


@pytest.mark.parametrize(("args", "message"), NUMBERS, ids=[" ".join(a) for a, _ in NUMBERS])
def test_bad_numbers_and_options(example, capsys, args, message):
    refused(example, capsys, args, message)


# ---- the network, the devices, the plan --------------------------------------------------------------
OTHERS = [
    (["--arch", "5"], "argument --arch: '5' is not C1:C2"),
    (["--arch", "0:8"], "argument --arch: '0:8' is not C1:C2"),
    (["--backend", "cuda"], "--backend cuda: not one of numpy"),
    (["--device", "0:0"], "--device 0:0: the numpy backend has no devices to choose from"),
    (["--worker-device", "1"], "--worker-device 1: the numpy backend has no devices to choose from"),
    (["--plan", "fixed", "--rebalance", "on"], "--rebalance on contradicts --plan fixed"),
    (["--plan", "equal", "--rebalance", "on"], "--rebalance on contradicts --plan equal"),
    (["--checkpoint-every", "5"], "--checkpoint-every and --checkpoint-minutes need --checkpoint FILE"),
]


@pytest.mark.parametrize(("args", "message"), OTHERS, ids=[" ".join(a) for a, _ in OTHERS])
def test_bad_network_devices_and_plans(example, capsys, args, message):
    refused(example, capsys, args, message)


@pytest.mark.parametrize("args", [["--arch", "100000:100000"], ["--batch-size", "100000000"]])
def test_a_network_too_large_for_this_machine(example, capsys, args):
    err = refused(example, capsys, args, "for a training step (im2col columns, activations and their gradients")
    need, have = re.search(r"needs about ([\d.]+) GiB .* this machine has ([\d.]+) GiB available", err).groups()
    assert float(need) > float(have)


# ---- output paths ----------------------------------------------------------------------------------
@pytest.mark.parametrize("option", ["--metrics-out", "--checkpoint"])
def test_output_paths_that_cannot_be_written(example, capsys, tmp_path, option):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    refused(example, capsys, [option, str(a_file / "x" / "run.out")], f"cannot be written: {a_file} is a file")
    refused(example, capsys, [option, str(tmp_path)], f"{option} {tmp_path} is a folder")
    if Path("/proc/self").is_dir():  # a folder where nobody, not even root, can create a file
        refused(example, capsys, [option, "/proc/self/run.out"], f"{option} /proc/self/run.out cannot be written")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]  # the checks created nothing


# ---- checkpoints to resume from -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory) -> Path:
    """A checkpoint of --arch 4:8 --norm lrn --pool 3 --batch-size 32, as the trainer writes it."""
    path = tmp_path_factory.mktemp("ck") / "good.npz"
    data = synthetic_dataset(n_train=64, n_test=8, seed=0)
    Trainer(paper_net("4:8", "numpy", "lrn"), data, TrainConfig(batch_size=32, progress=False)).save(path)
    return path


def resume(example, capsys, path: Path, message: str, *more: str) -> None:
    refused(example, capsys, ["--resume", str(path), *more], message)


def test_resume_from_missing_empty_truncated_or_corrupted_files(example, capsys, tmp_path, good_checkpoint):
    raw = good_checkpoint.read_bytes()
    resume(example, capsys, tmp_path / "missing.npz", "no checkpoint at")
    (tmp_path / "empty.npz").write_bytes(b"")
    resume(example, capsys, tmp_path / "empty.npz", "is empty, not a checkpoint")
    for n in (10, len(raw) // 2, len(raw) - 1):
        (tmp_path / "cut.npz").write_bytes(raw[:n])
        resume(example, capsys, tmp_path / "cut.npz", "is not a readable tinyconv checkpoint")
    flipped = bytearray(raw)
    flipped[len(raw) // 3] ^= 0xFF  # in the arrays: the zip's CRC
    (tmp_path / "flipped.npz").write_bytes(bytes(flipped))
    resume(example, capsys, tmp_path / "flipped.npz", "BadZipFile")
    (tmp_path / "text.npz").write_text("hello")
    resume(example, capsys, tmp_path / "text.npz", "is not a readable tinyconv checkpoint")


def _rewritten(path: Path, dest: Path, edit) -> Path:
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(str(arrays.pop("meta")))
    meta.pop("format")
    edit(meta)
    model = {k[6:]: v for k, v in arrays.items() if k.startswith("model/")}
    optim = {k[6:]: v for k, v in arrays.items() if k.startswith("optim/")}
    save_checkpoint(dest, model, optim, meta)
    return dest


def test_resume_with_missing_or_wrong_typed_fields(example, capsys, tmp_path, good_checkpoint):
    edits = [
        (lambda m: m.pop("augment_state"), "its meta has no field 'augment_state'"),
        (lambda m: m.update(step="12"), "its meta field 'step' is '12' (str), not an int"),
        (lambda m: m["model_config"].pop("norm"), "its meta has no field 'model_config.norm'"),
        (lambda m: m.update(epoch_shuffle_state={"state": 1}), "'epoch_shuffle_state' is not a generator state"),
    ]
    for i, (edit, message) in enumerate(edits):
        resume(example, capsys, _rewritten(good_checkpoint, tmp_path / f"{i}.npz", edit), message)


@pytest.mark.parametrize(
    ("args", "differs"),
    [
        (["--pool", "2"], "--pool 3 there, 2 here"),
        (["--norm", "batch"], "--norm lrn there, batch here"),
        (["--arch", "6:8"], "--arch 4:8 there, 6:8 here"),
        (["--conv2", "9"], "--arch 4:8 there, 4:9 here"),
        (["--batch-size", "16"], "--batch-size 32 there, 16 here"),
    ],
)
def test_resume_from_another_run(example, capsys, good_checkpoint, args, differs):
    resume(example, capsys, good_checkpoint, differs, *args)


# ---- options the rest of the command line makes meaningless, and old spellings (#39) ------------------------------
MEANINGLESS = [
    (["--wire-precision", "bf16", "--workers", "0"], "--wire-precision is for the workers, and --workers 0 has none"),
    (["--threads", "4", "--workers", "0"], "--threads is for the workers, and --workers 0 has none"),
    (["--parallel", "data", "--split", "channels"], "--split channels shapes the split of --parallel model"),
    (["--parallel", "hybrid", "--fuse", "off"], "--fuse off shapes the split of --parallel model"),
    (["--bind", "tcp://127.0.0.1:5999", "--transport", "inproc"], "--bind is for --transport zmq, not inproc"),
    (["--external-workers", "--transport", "inproc"], "--external-workers is for --transport zmq, not inproc"),
    (["--transport", "tcp"], "--transport tcp: not one of"),
    (["--seed", "-1"], "argument --seed: must be 0 or more, got -1"),
    (["--arch", "-5:10"], "argument --arch: '-5:10' is not C1:C2"),
    (["--worker-threads", "2"], "--worker-threads is now --threads"),
    (["--batch", "64"], "--batch is now --batch-size"),
]


@pytest.mark.parametrize(("args", "message"), MEANINGLESS, ids=[" ".join(a) for a, _ in MEANINGLESS])
def test_an_option_that_cannot_apply_is_refused_before_any_work(example, capsys, args, message):
    refused(example, capsys, args, message)


def test_a_port_in_use_is_refused_before_the_data_loads(example, capsys):
    import socket

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        err = refused(example, capsys, ["--transport", "zmq", "--bind", f"tcp://127.0.0.1:{port}"], f":{port}: ")
    assert "choose another port" in err


def test_missing_data_with_no_download_is_refused_before_any_work(example, capsys, tmp_path):
    refused(
        example, capsys, ["--dataset", "cifar10", "--no-download", "--data-dir", str(tmp_path)], "CIFAR-10 is not in"
    )


def test_a_failure_during_the_run_exits_1_not_2(example, capsys):
    # the options pass (opencl has devices); the worker process finds no such device and exits before its hello
    failing = ["--transport", "zmq", "--workers", "1", "--worker-backend", "opencl", "--worker-device", "nosuchdevice"]
    code = example.main([*BASE, "--steps", "1", *failing])
    out, err = capsys.readouterr()
    assert code == 1 and "error: local worker 0 died before saying hello" in err and "Traceback" not in err, err


def test_print_config_writes_a_file_that_config_reads_back(example, capsys, tmp_path):
    assert example.main([*BASE, "--preset", "paper", "--lr", "0.02", "--workers", "0", "--print-config"]) == 0
    text = capsys.readouterr().out
    assert 'arch = "4:8"' in text and "lr = 0.02" in text and 'preset = "paper"' in text and "changed" not in text
    (tmp_path / "run.toml").write_text(text)
    again = example.build_parser().parse_args(["--config", str(tmp_path / "run.toml")])
    train_checks.apply_preset(again)
    assert (again.arch, again.lr, again.batch_size, again.dataset) == ("4:8", 0.02, 32, "synthetic")
    given = example.build_parser().parse_args(["--config", str(tmp_path / "run.toml"), "--lr", "0.03"])
    assert given.lr == 0.03  # the command line wins over the file


def test_a_config_key_that_is_no_option_is_refused(example, capsys, tmp_path):
    (tmp_path / "bad.toml").write_text('arch = "4:8"\nlearning-rate = 0.1\n')
    refused(example, capsys, ["--config", str(tmp_path / "bad.toml")], "'learning-rate' is not an option of")
