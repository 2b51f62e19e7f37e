"""The running detector: control streams, scheduling, the store, the query API, metrics and the wiring."""
