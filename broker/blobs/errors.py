"""Errors of the blob stores."""
from __future__ import annotations

from broker.errors import BrokerError


class BlobStoreUnavailable(BrokerError):
    """The object store refused or could not be reached: retry later."""
    code, http_status, grpc_status, title = ("blob_store_unavailable", 503, "UNAVAILABLE",
                                             "Blob store unavailable")


class BlobCorrupt(BrokerError):
    """A stored object's bytes or checksum are not those its key names."""
    code, http_status, grpc_status, title = ("blob_corrupt", 500, "DATA_LOSS", "Blob corrupt")
