"""The gRPC gateway agents connect to (sdk/protocol/agent.proto)."""
