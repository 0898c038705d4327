"""Generated protobuf and gRPC modules for kvstore.internal.v1 (proto/kvstore/internal/v1). Built by `make proto`."""
