"""A user predicate for the pipeline's tests; Spark ships this file to its Python workers (``addPyFile``)."""

from __future__ import annotations

from stablewatch.v1 import GlobalSnapshot


def queues_short(snapshot: GlobalSnapshot) -> dict[str, object] | None:
    """Holds when no process reports a ``queue`` attribute of 4 or more; unknown when none reports one."""
    queues = [p.state.attributes["queue"] for p in snapshot.processes if "queue" in p.state.attributes]
    if not queues:
        return None
    return {"holds": max(queues) < 4, "summary": f"longest queue {max(queues):g}", "details": {"longest": max(queues)}}
