"""The Sparecycles broker: REST API, admin console, gRPC gateway for agents, the market's
domain (jobs, auction, ledger, verification) and its storage."""
