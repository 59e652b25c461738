"""Accounts, API keys (stored hashed) and the principals requests act as."""
