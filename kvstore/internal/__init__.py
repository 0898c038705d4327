"""Node-internal schemas (proto/kvstore/internal): not the client API, no compatibility promise.

`kvstore.internal.v1` holds the generated modules of the peer service nodes call among
themselves (`peer.proto`) and of the WAL entry the store writes into each record's payload
(`wal_entry.proto`). Clients use `kvstore.v1` (through `kvstore.client`) only.
"""
