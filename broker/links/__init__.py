"""Links between operator accounts: what the broker can see that says two accounts may be
one person's (issue #20). See :mod:`broker.links.service`."""
from .service import LinkKind, LinkService, LinkSettings, Signal, unlinked_pair

__all__ = ["LinkKind", "LinkService", "LinkSettings", "Signal", "unlinked_pair"]
