"""A result row's verdict as a Spark column: :class:`~stablewatch.detector.evaluation.Verdict`'s rule and words.

The pipeline counts and follows verdicts over millions of result rows (``holds``, ``unknown`` and
``error`` columns, as the archive and :data:`~stablewatch.pipeline.evaluate.EVALUATIONS` hold
them), so the rule runs inside Spark rather than row by row in Python: :func:`verdict` is
:meth:`Verdict.of_fields` written as one column expression, with its words taken from
:class:`Verdict`.
"""

from __future__ import annotations

from pyspark.sql import Column
from pyspark.sql import functions as F

from stablewatch.detector.evaluation import Verdict

__all__ = ["verdict"]


def verdict() -> Column:
    """``"true"``, ``"false"`` or ``"unknown"`` for each row of result columns ``holds``, ``unknown`` and
    ``error``: unknown when the cut could not decide or a user predicate failed, else whether it holds.

    A null counts as Python's None does in :meth:`Verdict.of_fields`: not set.
    """
    undecided = F.coalesce(F.col("unknown"), F.lit(False)) | (F.coalesce(F.col("error"), F.lit("")) != "")
    return (
        F.when(undecided, F.lit(Verdict.UNKNOWN.value))
        .when(F.coalesce(F.col("holds"), F.lit(False)), F.lit(Verdict.TRUE.value))
        .otherwise(F.lit(Verdict.FALSE.value))
    )
