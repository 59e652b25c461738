"""Jobs: the lifecycle of DESIGN §2 (states, leases, attempts) and the service that drives it."""
