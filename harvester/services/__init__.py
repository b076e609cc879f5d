"""Services the sidecar hosts beside publishing: the acker, the claim settler, the sweeper, the HTTP tracking service."""
