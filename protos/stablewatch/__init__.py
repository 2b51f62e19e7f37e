"""stablewatch: detect stable properties (deadlock, termination, lost tokens) in running systems.

Subpackages: ``stablewatch.v1`` (the wire contract), ``stablewatch.agents`` (the embeddable agent)
and ``stablewatch.detector`` (the central detector).
"""

__version__ = "0.1.0"
