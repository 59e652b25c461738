"""Blob storage for outputs and checkpoints: a local folder by default
(:class:`~broker.blobs.local.LocalBlobStore`), or an S3-compatible bucket through boto3
(:class:`~broker.blobs.s3.S3BlobStore`) whose presigned URLs keep output bytes off the broker."""
