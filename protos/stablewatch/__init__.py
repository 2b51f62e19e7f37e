"""stablewatch: detect stable properties (deadlock, termination, lost tokens) in running systems.

Subpackages: ``stablewatch.v1`` (the wire contract), ``stablewatch.agents`` (the embeddable agent),
``stablewatch.detector`` (the central detector), ``stablewatch.pipeline`` (the Spark jobs over the
archive) and ``stablewatch.cli`` (the ``stablewatch`` command).
"""

from importlib.metadata import version

#: The installed distribution's version: pyproject.toml is the one place it is written.
__version__ = version("stablewatch")
