"""Per-device worker processes: backends, graph programs, the step pipeline."""
