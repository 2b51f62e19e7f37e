"""The Parquet archive of completed snapshots: its schema, the batched writer and the reader."""
