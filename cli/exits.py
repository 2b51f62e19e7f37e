"""The exit statuses of the ``stablewatch`` commands, one meaning each.

0 success, 1 the detector is unreachable or refused (``resolve``: nothing to break, or no victim
reached; or a simulation differs from the expected snapshots), 2 bad flags or input (for
``archive``: a bad store, archive or file), 3 ``snapshot`` was aborted (``simulate``: a snapshot
failed), 130 interrupted.
"""

from __future__ import annotations

__all__ = ["EXIT_ABORTED", "EXIT_BAD_INPUT", "EXIT_ERROR", "EXIT_INTERRUPTED", "EXIT_MISMATCH"]

EXIT_MISMATCH = 1
EXIT_ERROR = 1  # the detector is unreachable, refused the request, or cannot start
EXIT_BAD_INPUT = 2  # argparse exits with it too
EXIT_ABORTED = 3  # `snapshot`: the snapshot was aborted; `simulate`: a snapshot failed
EXIT_INTERRUPTED = 130  # Ctrl-C, except in `watch` where it is the normal way out
