"""The most bytes each string of the wire contract may take, and how a refusal quotes one.

Both sides hold to them: the detector checks every string an agent or a client sends before it
logs, stores or echoes it (a Register over a bound is refused, a part holding one is rejected),
and the agent's API refuses longer ones at once, so an application learns of a name the detector
would reject when it sets it. A refusal quotes at most a short prefix (:func:`quoted_prefix`), so
its size never grows with its input.
"""

from __future__ import annotations

import math
import re

from google.protobuf.struct_pb2 import Struct

__all__ = [
    "MAX_ADDRESS_BYTES",
    "MAX_COUNTER_UNITS",
    "MAX_ID_BYTES",
    "MAX_NAME_BYTES",
    "MAX_TASK_BYTES",
    "MAX_TEXT_BYTES",
    "has_control_character",
    "names_a_wait",
    "non_finite",
    "process_id_problem",
    "quoted_prefix",
    "text_problem",
    "too_long",
]

MAX_ID_BYTES = 256  # a process id: a Register's, a part's, a channel's other end, a wait target's
MAX_NAME_BYTES = 256  # a counter's or an attribute's name; a Register's agent version
#: A task: a waiter, a wait target's task, the task a recorded message wakes. RPC mode names a
#: call's task ``"{method}#{process}:{seq}"``, so any method name up to 746 bytes fits.
MAX_TASK_BYTES = 1024
MAX_ADDRESS_BYTES = 512  # a Register's address (host:port; a DNS name takes 253 at most)
MAX_TEXT_BYTES = 64 * 1024  # each string inside an attribute's value, and each key below its name
#: The units of one counter in a cut, every amount counted by its magnitude (in states and on
#: recorded messages), and an expected total: so that every total, channel sum and drift the
#: evaluation, the archive and the pipeline count stays a 64-bit integer.
MAX_COUNTER_UNITS = 2**62 - 1

_CONTROL_CHARACTER = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def too_long(text: str, limit: int) -> bool:
    """Whether `text` takes more than `limit` bytes in UTF-8 (encoded only when its length cannot tell)."""
    length = len(text)
    return length > limit or (length * 4 > limit and len(text.encode()) > limit)


def has_control_character(text: str) -> bool:
    """Whether `text` holds a control character (C0, DEL or C1): never in an id or a name, where it
    could forge a log line or a terminal's display."""
    return _CONTROL_CHARACTER.search(text) is not None


def quoted_prefix(text: str, limit: int = 64) -> str:
    """``repr`` of at most the first `limit` characters of client-controlled `text`, with its full
    length when cut: what a refusal or a log line may quote, whatever the size of the input."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} characters)"


def text_problem(text: str, limit: int) -> str | None:
    """What makes `text`, an id or a name of at most `limit` bytes, one the detector refuses: it
    ``"is longer than N bytes"`` or ``"holds a control character"``; None when it is fine. The
    usual short printable name is told in two C calls."""
    if len(text) * 4 <= limit and text.isprintable():
        return None
    if too_long(text, limit):
        return f"is longer than {limit} bytes"
    if has_control_character(text):
        return "holds a control character"
    return None


def process_id_problem(process_id: str) -> str | None:
    """What makes `process_id` one the detector refuses (empty, over :data:`MAX_ID_BYTES`, a control
    character), or None when it is fine."""
    if not process_id:
        return "process id is empty"
    problem = text_problem(process_id, MAX_ID_BYTES)
    return None if problem is None else f"process id {quoted_prefix(process_id)} {problem}"


# The end of the task of one wait's own node in the detector's wait-for graph.
_WAIT_NODE = re.compile(r"\[wait [0-9]+\]\Z")


def names_a_wait(task: str) -> bool:
    """Whether `task` has the form the detector's wait-for graph gives the node of one wait of a task
    that has several, ``"task[wait k]"``: such a name, reported as a task, would be taken for that
    node, so the detector refuses it and the agent's API does too.

    >>> names_a_wait("t[wait 2]"), names_a_wait("t[wait]"), names_a_wait("/svc/M#p:3")
    (True, False, False)
    """
    return "[wait " in task and _WAIT_NODE.search(task) is not None


def non_finite(attributes: Struct) -> tuple[str, float] | None:
    """The first number in ``attributes`` (a Struct: a state's attributes, a result's details), at
    any depth, that is NaN or infinite, with the name of the field holding it: such a number has no
    JSON, so the archive could not keep it, nor the pipeline write it."""
    for name, top in attributes.fields.items():
        values = [top]
        while values:
            value = values.pop()
            kind = value.WhichOneof("kind")
            if kind == "number_value":
                if not math.isfinite(value.number_value):
                    return name, value.number_value
            elif kind == "struct_value":
                values.extend(value.struct_value.fields.values())
            elif kind == "list_value":
                values.extend(value.list_value.values)
    return None
