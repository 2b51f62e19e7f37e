"""The front door: the ``stablewatch`` command, the query API client, the live demo and renderings."""
