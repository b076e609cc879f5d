"""The tracker's I/O-free core: each operation is a generator of steps (core.steps) that a driver runs."""
