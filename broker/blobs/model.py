"""What the blob stores hand out."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PresignedPut:
    """A URL an uploader PUTs one blob to, with the headers it must send (they are signed)."""

    url: str
    headers: dict[str, str]
    expires_at: float  # epoch seconds


@dataclass(frozen=True)
class StoredBlob:
    """One blob as a listing of the store shows it."""

    key: str
    size: int
    modified_at: float  # epoch seconds
