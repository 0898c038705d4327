"""Which shard owns a key: `crc32(key) mod S`, S fixed when the cluster is created.

CRC-32 (zlib, IEEE polynomial) is stable across processes, languages and versions, and Spark SQL
computes the same value with `pmod(crc32(key), S)`, so the Spark jobs route keys exactly as the
store does.
"""

from __future__ import annotations

import zlib


def shard_of(key: bytes, shard_count: int) -> int:
    assert shard_count > 0, f"shard_count must be positive: {shard_count}"
    return zlib.crc32(key) % shard_count
