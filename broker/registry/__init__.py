"""The plugin and adapter registry: publisher keys, signed immutable package versions,
their files in the blob store, adapter royalties and which agents hold what warm."""
from .service import PackageRecord, PublisherKey, RegistryService, Royalty  # noqa: F401
from .warm import WarmIndex  # noqa: F401
