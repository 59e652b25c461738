"""Providers: the machines that run jobs, identified by their Ed25519 keys."""
