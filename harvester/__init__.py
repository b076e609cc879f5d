"""The `reaper` sidecar: leader election, outbox harvesting, acker and sweeper hosting."""
