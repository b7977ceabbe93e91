"""Every command's options, each defined once: one spelling per concept and one meaning per name.

``tinyconv train``, ``worker``, ``experiment grid``, ``simulate``, ``comm`` and the benchmarks build their
parsers from :data:`OPTIONS` (``add(group, "arch", "batch_size")``), so ``--batch-size`` is the images per
step wherever it appears; a command that sweeps a setting takes a list of the same option
(``add(group, "arch", many={"arch"})``: ``--arch 50:500 300:1000``). docs/commands.md has the vocabulary table.

A spelling that was renamed is refused in one line that gives the new one (:data:`RENAMED`). ``--config
FILE`` reads a TOML file of options (``arch = "64:128"``); its values go in front of the command line, so an
option given there wins. ``--print-config`` writes the settings a run resolved in the same form.

Nothing here imports numpy: ``tinyconv worker --threads N`` sets the BLAS threads before it loads.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

PAPER_ARCHS = ("50:500", "150:800", "300:1000", "500:1500")  # tinyconv.model's (a test holds them equal)
NORMS = ("lrn", "batch", "none")
PARALLEL = ("model", "data", "hybrid")
SPLITS = ("auto", "channels", "kernels")
WIRE_PRECISIONS = ("fp32", "adt24", "bf16", "fp16", "s8", "adaptive")  # adaptive_precision.SETTINGS's (tested)
RENAMED = {  # an old spelling -> today's; refused with the new name, so a script's author knows what to write
    "--archs": "--arch",
    "--batch": "--batch-size",
    "--batches": "--batch-size",
    "--participants": "--workers (workers beside the master: --participants 3 is --workers 2)",
    "--nodes": "--workers (workers beside the master: --nodes 4 is --workers 3)",
    "--worker-threads": "--threads",
    "--timeout": "--peer-timeout (a silent peer) or --start-timeout (the wait at the start)",
    "--connect-timeout": "--start-timeout",
    "--quiet": "--no-progress",
    "--devices": "--cpu-quota (emulated devices) or --device-file (the simulator's measured devices)",
    "--name": "--device-name",
    "--warmup-steps": "--untimed-steps",
}


class UsageError(Exception):
    """A bad command line: one line on stderr and exit 2, before any work starts."""


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (:class:`UsageError`), renamed spellings refused, and ``--config FILE``."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see {self.prog} --help)")

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> argparse.Namespace:  # type: ignore[override]
        args = list(sys.argv[1:] if args is None else args)
        own = {flag for action in self._actions for flag in action.option_strings}
        for word in args:
            flag = word.split("=", 1)[0]
            if flag in RENAMED and flag not in own:
                raise UsageError(f"{flag} is now {RENAMED[flag]} (see {self.prog} --help)")
        if "--config" in own:
            args = config_arguments(self, args) + args
        return super().parse_args(_values_that_look_like_flags(self, args), namespace)


def _values_that_look_like_flags(parser: argparse.ArgumentParser, args: list[str]) -> list[str]:
    """``--arch -5:10`` as ``--arch=-5:10``, so that its type says what is wrong with the value, where argparse
    would take ``-5:10`` for an option and say only "expected one argument"."""
    takes_one = {f for a in parser._actions if a.nargs is None and a.option_strings for f in a.option_strings}
    own = {f for a in parser._actions for f in a.option_strings}
    out: list[str] = []
    for word in args:
        if out and out[-1] in takes_one and word.startswith("-") and word.split("=", 1)[0] not in own:
            out[-1] = f"{out[-1]}={word}"
        else:
            out.append(word)
    return out


# ---- value types: a bad value is one line that names the option and says what it takes --------------------
def count(low: int) -> Callable[[str], int]:
    """A whole number >= ``low``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be {low} or more, got {value}")
        return value

    return parse


def number(low: float, high: float = math.inf, low_open: bool = False, what: str = "") -> Callable[[str], float]:
    """A finite float in [low, high) (or (low, high) with ``low_open``)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not (math.isfinite(value) and (value > low if low_open else value >= low) and value < high):
            interval = f"{'(' if low_open else '['}{low:g}, {high:g})" if high < math.inf else None
            bound = f"in {interval}" if interval else f"{'>' if low_open else '>='} {low:g}"
            raise argparse.ArgumentTypeError(f"must be {what or 'a number'} {bound}, got {text}")
        return value

    return parse


POSITIVE = number(0, low_open=True)
NON_NEGATIVE = number(0)


def arch(text: str) -> str:
    """``C1:C2``, two kernel counts of at least 1 (tinyconv.model.parse_arch reads it)."""
    m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", text)
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not C1:C2, the kernel counts of the two conv layers (the paper's: {', '.join(PAPER_ARCHS)})"
        )
    return f"{int(m.group(1))}:{int(m.group(2))}"


def cores(text: str) -> float:
    """A share of one core, in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of cores") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be a share of one core in (0, 1], got {text}")
    return value


def one_of(choices: Iterable[str]) -> Callable[[str], str]:
    """One of ``choices``; anything else is refused with the list of them."""
    allowed = tuple(choices)

    def parse(text: str) -> str:
        if text not in allowed:
            raise argparse.ArgumentTypeError(f"must be one of {', '.join(allowed)}, got {text!r}")
        return text

    return parse


# ---- the options ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Option:
    """One option as every command spells it: its flag, what it takes, its help and its default; a command
    adds its own sentence or default with :func:`add`'s ``helps`` and ``defaults``."""

    flag: str
    help: str
    type: Callable[[str], Any] | None = None
    default: Any = None
    metavar: str | None = None
    flag_only: bool = False  # a switch: present or not


OPTIONS: dict[str, Option] = {
    o.flag[2:].replace("-", "_"): o
    for o in (
        Option(
            "--arch",
            "kernel counts C1:C2 of the two conv layers; the paper's are " + ", ".join(PAPER_ARCHS),
            arch,
            metavar="C1:C2",
        ),
        Option("--batch-size", "images per step", count(1), metavar="N"),
        Option(
            "--norm",
            "normalisation after each conv: lrn (the paper's), batch or none",
            one_of(NORMS),
            metavar="{" + ",".join(NORMS) + "}",
        ),
        Option("--backend", "the compute backend: numpy or opencl (`tinyconv devices` lists them)", metavar="NAME"),
        Option(
            "--device",
            "the OpenCL device: PLATFORM:DEVICE or a name substring (`tinyconv devices` lists them; "
            "default $TINYCONV_OPENCL_DEVICE, else the first GPU); only for a backend with devices",
            metavar="P:D",
        ),
        Option("--workers", "workers beside the master (0: the master alone, the baseline)", count(0), metavar="N"),
        Option(
            "--threads",
            "BLAS/OpenMP threads of each worker process (sets OMP/OPENBLAS/MKL_NUM_THREADS before numpy loads)",
            count(1),
            metavar="N",
        ),
        Option(
            "--parallel",
            "model: the paper's split of each convolution's kernels; data: a whole replica and a "
            "share of the images each; hybrid: the convolutions by data, the fully connected layer on the master",
            one_of(PARALLEL),
            metavar="{" + ",".join(PARALLEL) + "}",
        ),
        Option("--transport", "how the master reaches its workers: inproc, zmq or mpi", metavar="NAME"),
        Option("--bind", "zmq: the master's address, tcp://HOST:PORT or ipc:///path", metavar="ADDR"),
        Option(
            "--insecure", "zmq: bind beyond loopback without keys: anyone who reaches the port can join", flag_only=True
        ),
        Option(
            "--fuse",
            "on: workers also run the ReLU, norm and pool after each conv on their own channels; "
            "off: the paper's split, conv only",
            one_of(("on", "off")),
            metavar="{on,off}",
        ),
        Option(
            "--split",
            "how each conv after the first is split: kernels (the paper's), channels (by input "
            "channels), auto (channels with every worker on this machine, else kernels)",
            one_of(SPLITS),
            metavar="{" + ",".join(SPLITS) + "}",
        ),
        Option(
            "--rebalance",
            "re-split from measured step times when a participant lags",
            one_of(("on", "off")),
            metavar="{on,off}",
        ),
        Option(
            "--wire-precision",
            "the words the shards travel in: fp32 (4 bytes), adt24 (3: float32's top 3), "
            "bf16 (2: its top 2), fp16 (2: IEEE half), s8 (1: int8 times a scale per plane) or adaptive (weights "
            "widen bf16 -> adt24 -> fp32 as they settle)",
            one_of(WIRE_PRECISIONS),
            metavar="FORMAT",
        ),
        Option(
            "--start-timeout",
            "seconds to wait at the start for the other side (the workers' hello, or the master's welcome)",
            POSITIVE,
            metavar="S",
        ),
        Option(
            "--peer-timeout",
            "the most seconds a peer may be silent before it is lost: a ceiling, as the "
            "patience follows the peer's pace",
            POSITIVE,
            metavar="S",
        ),
        Option("--seed", "seeds the weights, the shuffle and the augmentation", count(0), default=0, metavar="N"),
        Option("--repeats", "times each measurement is repeated; the median is kept", count(1), metavar="N"),
        Option("--timed-steps", "steps timed per measurement", count(1), metavar="N"),
        Option("--untimed-steps", "steps run first and not timed (caches, allocations)", count(0), metavar="N"),
        Option(
            "--slowdown",
            "testing aid: a device F >= 1 times slower (2: half speed)",
            number(1, what="a factor"),
            metavar="F",
        ),
        Option(
            "--cpu-quota",
            "emulated devices: each participant, the master's first, in a cgroup CPU quota of "
            "CORES of one core (0.5 0.5 0.5 0.5: four half-core devices)",
            cores,
            metavar="CORES",
        ),
        Option("--device-file", "the simulator's file of measured devices (JSON)", metavar="FILE"),
        Option("--device-name", "a device's name in --device-file", metavar="NAME"),
        Option("--out", "where this command writes its result", metavar="PATH"),
        Option(
            "--no-progress",
            "no progress bars or progress lines (they are off anyway when the output is not a terminal)",
            flag_only=True,
        ),
    )
}


def add(
    group: argparse.ArgumentParser | argparse._ArgumentGroup,
    *names: str,
    many: Iterable[str] = (),
    defaults: dict[str, Any] | None = None,
    helps: dict[str, str] | None = None,
) -> None:
    """Add the named options to ``group``; ``many``: those this command takes as a list (a sweep),
    ``defaults``/``helps``: this command's default, and a sentence it adds to the shared help."""
    many, defaults, helps = set(many), defaults or {}, helps or {}
    for name in names:
        o = OPTIONS[name]
        default = defaults.get(name, o.default)
        text = o.help + (f"; {helps[name]}" if name in helps else "")
        if default is not None and not o.flag_only:
            shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else default
            text += f" (default {shown})"
        text = text.replace("%", "%%")
        if o.flag_only:
            group.add_argument(o.flag, action="store_true", help=text)
            continue
        nargs = {"nargs": "+"} if name in many else {}
        group.add_argument(o.flag, type=o.type, default=default, metavar=o.metavar, help=text, **nargs)


# ---- --config FILE and --print-config ------------------------------------------------------------------------
def add_config(parser: argparse.ArgumentParser) -> None:
    """``--config FILE`` and ``--print-config``: a run's settings kept in a file and read back."""
    g = parser.add_argument_group("settings in a file")
    g.add_argument(
        "--config",
        metavar="FILE",
        help="read options from this TOML file (name = value, as "
        "--print-config writes them); an option given on the command line wins",
    )
    g.add_argument(
        "--print-config",
        action="store_true",
        help="print the settings this run would use, as a --config file, and exit",
    )


def config_arguments(parser: argparse.ArgumentParser, args: list[str]) -> list[str]:
    """The arguments ``--config FILE`` in ``args`` stands for (none without it), checked against ``parser``."""
    path = next((a.split("=", 1)[1] for a in args if a.startswith("--config=")), None)
    if "--config" in args:
        at = args.index("--config")
        path = args[at + 1] if at + 1 < len(args) else None
        if path is None:
            raise UsageError(f"--config needs a file name (see {parser.prog} --help)")
    if path is None:
        return []
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the same parser, as a package (pyproject.toml's dependencies)
        import tomli as tomllib
    try:
        with open(path, "rb") as f:
            table = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise UsageError(f"--config {path}: {getattr(e, 'strerror', None) or e}") from None
    actions = {a.dest: a for a in parser._actions if a.option_strings}
    out: list[str] = []
    for key, value in table.items():
        action = actions.get(key.replace("-", "_"))
        if action is None or action.dest in ("config", "print_config", "help"):
            raise UsageError(f"--config {path}: {key!r} is not an option of {parser.prog} (see {parser.prog} --help)")
        flag = action.option_strings[-1]
        if isinstance(action, argparse._StoreTrueAction):
            out += [flag] if value is True else []
        else:
            out += [flag, *map(str, value if isinstance(value, list) else [value])]
    return out


def config_text(settings: dict[str, Any]) -> str:
    """``settings`` (an argparse namespace's vars) as a --config file: TOML, unset values left out."""
    lines = []
    for key, value in settings.items():
        if value is None or value is False or value == [] or key in ("config", "print_config"):
            continue
        lines.append(f"{key.replace('_', '-')} = {_toml(value)}")
    return "\n".join(lines)


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'
