"""Leader election: Fast NELI leases on the leader topic, one per harvest unit."""
