"""Blob storage for outputs and checkpoints: a local folder by default
(:class:`~broker.blobs.local.LocalBlobStore`), or an S3-compatible bucket through boto3
(:class:`~broker.blobs.s3.S3BlobStore`) whose presigned URLs keep output bytes off the broker."""


def job_blob_store(settings, at_rest=None):
    """The store for job outputs and checkpoints that ``settings`` (broker.settings) name.
    The local folder seals each file with ``at_rest`` (broker.storage.sealed.AtRestCipher)
    when given; an S3 bucket is written by agents directly (presigned PUTs), so what keeps
    its objects sealed at rest is the bucket's own server-side encryption."""
    if settings.blob_store == "s3":
        from .s3 import S3BlobStore

        store = S3BlobStore(settings.s3_bucket, endpoint_url=settings.s3_endpoint or None,
                           region=settings.s3_region or None, path_style=settings.s3_path_style,
                           prefix=settings.s3_prefix, get_ttl_s=settings.s3_get_ttl_s,
                           put_ttl_s=settings.s3_put_ttl_s,
                           access_key_id=settings.s3_access_key_id or None,
                           secret_access_key=settings.s3_secret_access_key or None,
                           session_token=settings.s3_session_token or None)
        store.ensure_bucket()  # and an unreachable store is said at start, not per job
        return store
    if at_rest is not None:
        from broker.storage.sealed import SealedBlobStore

        return SealedBlobStore(settings.blob_dir, at_rest)
    from .local import LocalBlobStore

    return LocalBlobStore(settings.blob_dir)
