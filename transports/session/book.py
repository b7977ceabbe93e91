"""The book: what a session's I/O thread and the caller's threads share, under one condition."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from transports.base import WorkerInfo


@dataclass
class Book:
    """What the I/O thread and the caller's threads share; ``cond`` guards every field."""

    cond: threading.Condition = field(default_factory=threading.Condition)
    admitting: bool = False  # start() was called
    fresh: list[WorkerInfo] = field(default_factory=list)  # admitted, not yet handed to the caller
    known: set[int] = field(default_factory=set)  # handed to the caller by start() or joined()
    lost: dict[int, str] = field(default_factory=dict)
    traffic: dict[int, list[int]] = field(default_factory=dict)  # worker index -> [sent, received]
    refusal: BaseException | None = None  # closed group: why start() cannot succeed
    failure: BaseException | None = None  # the I/O thread died of this
