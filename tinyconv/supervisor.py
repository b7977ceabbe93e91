"""A master that comes back by itself: training runs in a child process, restarted from its last checkpoint
(``--resume``) when it dies abnormally: a crash or a failure during the run (exit 1) or a signal it did not
handle (SIGKILL, the out-of-memory killer, a segfault). A run that ends as asked -- done (0), a usage error
(2), Ctrl-C (130), SIGTERM (143) -- would only end the same way again. Workers rejoin the new master.
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

ENDED_AS_ASKED = (0, 2, 128 + signal.SIGINT, 128 + signal.SIGTERM)
_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def supervise(
    command: Callable[[Path | None], list[str]], checkpoint: Path, max_restarts: int, say: Callable[[str], Any] = print
) -> int:
    """Run ``command(resume)`` (the training's argv; ``resume`` the checkpoint to resume from, or None) until
    it ends as asked or has been restarted ``max_restarts`` times -> its last exit code (a death by signal s
    as 128 + s, as a shell says it)."""
    restarts, resume = 0, None
    while True:
        child = subprocess.Popen(command(resume))
        say(f"supervisor: training in process {child.pid}" + (f", resumed from {resume}" if resume else ""))
        code = _wait(child)
        code = 128 - code if code < 0 else code
        if code in ENDED_AS_ASKED or restarts == max_restarts:
            if code not in ENDED_AS_ASKED:
                say(f"supervisor: training died (exit {code}) after {restarts} restart(s), the most allowed")
            return code
        restarts += 1
        resume = checkpoint if checkpoint.exists() else None
        say(f"supervisor: training died (exit {code}); restart {restarts} of {max_restarts}")


def _wait(child: subprocess.Popen) -> int:
    """The child's exit code. SIGTERM is passed on; Ctrl-C reaches the child by itself (the process group's)."""

    def forward(signum: int, _: Any) -> None:
        child.send_signal(signum)

    previous = {s: signal.signal(s, forward if s == signal.SIGTERM else signal.SIG_IGN) for s in _SIGNALS}
    try:
        return child.wait()  # the training's own length; a signal's handler runs while it waits
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def without_option(argv: list[str], option: str, takes_value: bool = True) -> list[str]:
    """``argv`` without ``option`` (as "--opt value" or "--opt=value")."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == option:
            skip = takes_value
        elif not arg.startswith(option + "="):
            out.append(arg)
    return out


def restartable_command(prefix: list[str], argv: list[str]) -> Callable[[Path | None], list[str]]:
    """The argv that runs the command ``prefix`` (``python -m tinyconv.cli train``) with ``argv`` again,
    without ``--max-restarts`` and, on a restart,
    with ``--resume`` at the checkpoint in place of any given."""

    def command(resume: Path | None) -> list[str]:
        args = without_option(argv, "--max-restarts")
        if resume is not None:
            args = [*without_option(args, "--resume"), "--resume", str(resume)]
        return [*prefix, *args]

    return command
