"""The reduction's defaults, in a module without PySpark: the command line builds its parser from them
before it knows whether PySpark is installed (:mod:`.cli`), and the jobs default to them."""

from __future__ import annotations

__all__ = ["DEFAULT_FINISH_EDGES", "DEFAULT_MAX_ROUNDS", "DEFAULT_MIN_RELEASE"]

#: Reduction rounds on DataFrames before what remains is finished by one process.
DEFAULT_MAX_ROUNDS = 8
#: Wait edges that one process takes whole, in compact form, without reducing on DataFrames first:
#: a snapshot with as many, or a remainder after rounds. The compact form of a million processes and
#: three million edges, with everything the results read, peaked at 1.9 GB in one process.
DEFAULT_FINISH_EDGES = 10_000_000
#: A round that removes less than this share of the edges it started with is the last one (0: no
#: round stops for that; the rounds run up to the cap, or until few enough edges remain).
DEFAULT_MIN_RELEASE = 0.0
