"""The reduction's settings (:class:`Reduction`) and their defaults, in a module without PySpark:
the command line builds its parser from them and checks its flags with :class:`Reduction` before
it knows whether PySpark is installed (:mod:`.cli`), and the jobs default to them."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "DEFAULT_FINISH_EDGES",
    "DEFAULT_MAX_ROUNDS",
    "DEFAULT_MIN_RELEASE",
    "DEFAULT_REDUCTION",
    "Reduction",
    "ReductionError",
]

#: Reduction rounds on DataFrames before what remains is finished by one process.
DEFAULT_MAX_ROUNDS = 8
#: Wait edges that one process takes whole, in compact form, without reducing on DataFrames first:
#: a snapshot with as many, or a remainder after rounds. The compact form of a million processes and
#: three million edges, with everything the results read, peaked at 1.9 GB in one process.
DEFAULT_FINISH_EDGES = 10_000_000
#: A round that removes less than this share of the edges it started with is the last one (0: no
#: round stops for that; the rounds run up to the cap, or until few enough edges remain).
DEFAULT_MIN_RELEASE = 0.0


class ReductionError(ValueError):
    """A :class:`Reduction` setting out of its range: `field` names it, `reason` says what it must be."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field} {reason}")
        self.field = field
        self.reason = reason


@dataclass(frozen=True)
class Reduction:
    """How the evaluation takes large snapshots: from their rows, each wait-for graph reduced on
    DataFrames first (:mod:`.reduce`) when too large for one process to take whole.

    * `reduce_above` — also evaluate from their rows the snapshots with more wait edges than this
      (None: only those archived without their blob).
    * `max_rounds` — DataFrame reduction rounds, at most, before one process finishes what remains.
    * `finish_edges` — a snapshot with this many wait edges or fewer is evaluated whole in compact
      form by one process; a larger one is reduced on DataFrames first, no round running once this
      many or fewer remain.
    * `min_release` — a round that removed less than this fraction (0 to 1) of the edges it
      started with is the last one: what remains is then mostly deadlocked and one process
      finishes it (0: no round stops for that).

    Raises :class:`ReductionError` (a ValueError) naming the first setting out of its range.
    """

    reduce_above: int | None = None
    max_rounds: int = DEFAULT_MAX_ROUNDS
    finish_edges: int = DEFAULT_FINISH_EDGES
    min_release: float = DEFAULT_MIN_RELEASE

    def __post_init__(self) -> None:
        for name in ("reduce_above", "max_rounds", "finish_edges"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ReductionError(name, f"must be at least 0, not {value}")
        if not 0.0 <= self.min_release <= 1.0:  # NaN too
            raise ReductionError("min_release", f"must be from 0 to 1, not {self.min_release}")


#: Every setting at its default: the jobs' default (one shared instance, as it is frozen).
DEFAULT_REDUCTION = Reduction()
