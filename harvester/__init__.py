"""The `reaper` sidecar: leader election, outbox harvesting, acker and sweeper hosting."""

from importlib.metadata import PackageNotFoundError, version


def product_version() -> str:
    """The installed distribution's version (`reaper --version`, the build-info metric, the start log)."""
    try:
        return version("outbox-reaper")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"
