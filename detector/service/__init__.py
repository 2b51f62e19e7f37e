"""The running detector: control streams, assembly, scheduling, the store, the query API and metrics."""
