"""What a consistent cut proves, as pure functions over a ``GlobalSnapshot``: no I/O, no clocks."""
