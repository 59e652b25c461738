"""Blob storage for outputs and checkpoints: a local folder by default (S3 later)."""
