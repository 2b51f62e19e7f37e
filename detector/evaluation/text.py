"""Words for summaries: counts with the right plural, and lists cut short. Shared by every summary."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["names", "plural"]

SHOWN = 6  # names listed before "..."


def plural(n: int, word: str, words: str = "") -> str:
    """``"1 channel"``, ``"2 channels"``; `words` for an irregular plural (``"processes"``)."""
    return f"{n} {word}" if n == 1 else f"{n} {words or word + 's'}"


def names(items: Sequence[str], shown: int = SHOWN) -> str:
    """The first `shown` items, comma-separated, then how many more there are."""
    listed = ", ".join(items[:shown])
    return listed + (f", ... ({len(items) - shown} more)" if len(items) > shown else "")
