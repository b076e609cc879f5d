"""Benchmarks: `python -m bench.<name>` (`--quick` for a short run); the last line of output is one JSON object."""
