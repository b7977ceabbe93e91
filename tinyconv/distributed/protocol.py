"""The task protocol: what the master asks a worker to compute, and what comes back.

A transport moves messages without knowing what they mean (``transports/wire.py`` checks the
envelope: kind, plain header, array dtypes and sizes); this file says what they mean. One task
kind per operation on the worker, each answered by a ``result`` carrying the seconds it computed
(``compute_s``) and the arrays below, or by an ``error`` naming what was wrong. Every task header
has ``task``, the id its reply echoes; a layer's tasks also ``step`` and ``layer`` (its index),
which tie the parts of one layer's step together on the worker.

The paper's split by kernels (``by_kernels.py``)::

    block_forward     stride, padding, tail, own     x (N, C, H, W), w (F', C, K, K), b (F',)
                                                     a bn: gamma, beta (F',); in eval running_mean, running_var
                      -> y (N, own, OH', OW'): the block of F' kernels (own and halo), the own ones' output;
                         a bn in training: the batch's mean, var (F',), unbiased
    block_backward    need_dx                        dy (N, F', OH', OW'), over every computed kernel
                                                     maybe probe (own + C K K,): the spot check's u, v
                      -> dx (N, C, H, W) if need_dx, a partial sum; dw (own, C, K, K), db (own,);
                         a bn: dgamma, dbeta (own,); a probe's sums s, a (2,) (replica/probe.py)

The other tasks (calibration, the split by input channels, data parallelism, the hybrid) are laid out in
docs/how-it-works.md. All arrays are float32 but labels (int32 or int64). Which task may follow which is
``worker/state.py``'s; narrower words on the wire are undone (``wire_codec.py``) before anything here checks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transports.base import Message
from transports.wire import Int, Num, ProtocolError, check_fields

# of this task protocol, wire_codec.py's ``narrow`` and ``reply`` included: one more for any change to a task or
# result; a worker's hello says which it speaks, the transport admits equals
VERSION = 15


class TaskError(ValueError):
    """A task the worker cannot run as asked; the text goes back to the master."""


@dataclass(frozen=True)
class Schema:
    """One task kind: its header keys (name -> type), and its arrays' names, space-separated: those it
    carries, those it may carry, those its result may carry (the master checks their shapes as it reads them)."""

    header: dict[str, type]
    arrays: str = ""
    optional: str = ""
    result: str = ""
    labels: str = ""  # arrays of integer labels (int32 or int64); every other is float32
    extra: dict[str, type] = field(default_factory=dict)  # header keys it may carry
    timed: bool = False  # its result says ``times``, seconds


_LAYER = {"task": Int, "step": Int, "layer": Int}
_CONV = _LAYER | {"stride": Int, "padding": Int, "tail": list}
_NET = {"task": Int, "net": dict, "batch": Int}
_CHUNK = {"images": list}  # a chunk of the batch, [a, b, N] (by_channels.py's pipeline)
NORM_INPUTS = ("gamma", "beta", "running_mean", "running_var")  # a tail's batch norm's (block.py)
_NORM = " ".join(NORM_INPUTS)

TASKS: dict[str, Schema] = {
    "calibrate": Schema({"task": Int, "layers": list, "repeats": Int}, timed=True),
    "block_forward": Schema(_CONV | {"own": list}, "x w b", _NORM, result="y mean var"),
    "block_backward": Schema(_LAYER | {"need_dx": bool}, "dy", "probe", result="dx dw db dgamma dbeta probes"),
    "partial_forward": Schema(
        _CONV | {"halo": list, "own": list, "give": list}, "x", optional="w", result="p_lo p_hi", extra=_CHUNK
    ),
    "tail_forward": Schema(_LAYER, optional="b sum " + _NORM, result="y mean var", extra=_CHUNK),
    "tail_backward": Schema(_LAYER, "dy", result="dyc dgamma dbeta", extra=_CHUNK),
    "partial_backward": Schema(
        _LAYER | {"need_dx": bool}, optional="dyc_lo dyc_hi probe", result="dx dw db probes", extra=_CHUNK
    ),
    "replica_calibrate": Schema(_NET | {"repeats": Int}, timed=True),
    "replica_step": Schema(
        _NET | {"step": Int}, "x y params", "buffers probe", "grads logits stats probes inner", "y", {"smoothing": Num}
    ),
    "hybrid_calibrate": Schema(_NET | {"repeats": Int}, timed=True),
    "hybrid_forward": Schema(_NET | {"step": Int}, "x params", "buffers probe", "features stats"),
    "hybrid_backward": Schema({"task": Int, "step": Int}, "dfeatures", result="grads probes inner"),
}


def check_task(msg: Message) -> None:
    """Raise TaskError unless ``msg`` is a known task with exactly its header keys, its arrays, float32.
    Values are checked for type only; their meaning (spans that fit, shapes that match) is each handler's."""
    schema = TASKS.get(msg.kind)
    if schema is None:
        raise TaskError(f"a worker does not handle {msg.kind!r} messages; send one of {', '.join(TASKS)}")
    try:
        check_fields(msg.kind, msg.header, schema.header, schema.extra)
    except ProtocolError as e:
        raise TaskError(str(e)) from None
    _check_arrays(msg.kind, msg, schema.arrays, f"{schema.arrays} {schema.optional}", TaskError, schema.labels)


def check_result(msg: Message, task_kind: str) -> None:
    """Raise RuntimeError unless ``msg`` is a well-formed result of a ``task_kind`` task."""
    schema = TASKS[task_kind]
    fields = {"task": Int, "compute_s": Num} | ({"times": list} if schema.timed else {})
    try:
        check_fields("result", msg.header, fields, {})
    except ProtocolError as e:
        raise RuntimeError(f"a malformed result of {task_kind}: {e}") from None
    if not msg.header["compute_s"] >= 0:
        raise RuntimeError(f"a result of {task_kind} reports compute_s {msg.header['compute_s']!r}, not seconds >= 0")
    _check_arrays(f"a result of {task_kind}", msg, "", schema.result, RuntimeError)


def _check_arrays(
    what: str, msg: Message, required: str, allowed: str, error: type[Exception], labels: str = ""
) -> None:
    names, need, may = set(msg.arrays), set(required.split()), set(allowed.split())
    if not need <= names <= may:
        optional = sorted(may - need)
        raise error(
            f"{what} takes the arrays {sorted(need)}{f' and optionally {optional}' if optional else ''}, "
            f"got {sorted(names) or 'none'}"
        )
    for name, a in msg.arrays.items():
        if name in labels.split():
            if a.dtype.name not in ("int32", "int64"):
                raise error(f"{what}: {name} holds labels and must be int32 or int64, got {a.dtype}")
        elif a.dtype.name != "float32":
            raise error(f"{what}: {name} must be float32, got {a.dtype}")
