"""Generated protobuf and gRPC modules for the kvstore.v1 API (proto/kvstore/v1). Built by `make proto`."""
