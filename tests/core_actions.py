"""Reading what a protocol core returns, in the tests of the marker core and of RPC mode's color core."""

from __future__ import annotations

from collections.abc import Sequence

from stablewatch.agents.core import Action, ReportPart
from stablewatch.v1 import LocalSnapshotPart

__all__ = ["only_part", "parts"]


def parts(actions: Sequence[Action]) -> list[LocalSnapshotPart]:
    """The local snapshot parts among ``actions``, in order."""
    return [action.part for action in actions if isinstance(action, ReportPart)]


def only_part(actions: Sequence[Action]) -> LocalSnapshotPart:
    """The one part among ``actions``."""
    found = parts(actions)
    assert len(found) == 1, f"expected one part, got {actions}"
    return found[0]
