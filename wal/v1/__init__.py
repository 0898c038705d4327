"""Generated protobuf modules for the WAL record schema (proto/wal/v1). Built by `make proto`."""
