"""The Sparecycles Python SDK.

>>> from sdk import Client
>>> client = Client()                       # SPARECYCLES_URL / SPARECYCLES_API_KEY
>>> result = client.generate("sd15", prompt="a lighthouse at dusk", seed=7)
>>> result.images[0].save("lighthouse.png")

``AsyncClient`` is its asyncio twin: the same names, awaited (``await client.generate(...)``,
``async for event in job.events()``, ``async for token in client.stream(...)``).

Names are imported lazily so that ``sdk.protocol`` (used inside plugin hosts) does not pull
in the HTTP client.
"""
from importlib import import_module

_EXPORTS = {
    "Client": "sdk.client", "AsyncClient": "sdk.aio", "Job": "sdk.client",
    "Result": "sdk.client", "Batch": "sdk.client", "Timeout": "sdk._core",
    **{name: "sdk.models" for name in (
        "Event", "Quote", "Account", "Transaction", "JobInfo", "OutputInfo")},
    **{name: "sdk.errors" for name in (
        "SparecyclesError", "ConfigurationError", "APIConnectionError", "APIError",
        "AuthenticationError", "PermissionDeniedError", "NotFoundError", "ConflictError",
        "InvalidInputError", "InsufficientCreditsError", "RateLimitError", "ServerError",
        "JobFailedError", "JobTimeoutError")},
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'sdk' has no attribute {name!r}")
