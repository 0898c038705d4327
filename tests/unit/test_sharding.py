"""The shard rule is pinned: an existing cluster's keys live where `crc32(key) mod S` put them, so the
rule may never change by accident (a changed hash would misroute every key of a running cluster,
and every Spark job's `pmod(crc32(key), S)` with it). The values are CRC-32 (IEEE) as published."""

from __future__ import annotations

import pytest

from kvstore.core.sharding import shard_of


@pytest.mark.parametrize(("key", "shards"), [
    (b"", {1: 0, 2: 0, 4: 0, 16: 0, 1024: 0}),  # crc32(b"") = 0
    (b"a", {1: 0, 2: 1, 4: 3, 16: 3, 1024: 579}),  # crc32(b"a") = 0xE8B7BE43
    (b"hello", {1: 0, 2: 0, 4: 2, 16: 6, 1024: 646}),  # 0x3610A686
    (b"user/42", {1: 0, 2: 1, 4: 1, 16: 13, 1024: 29}),  # 2122476573
    (bytes(range(256)), {1: 0, 2: 1, 4: 3, 16: 3, 1024: 115}),  # 688229491
], ids=["empty", "a", "hello", "user/42", "all-bytes"])
def test_keys_land_where_crc32_mod_s_puts_them(key: bytes, shards: dict[int, int]) -> None:
    assert {count: shard_of(key, count) for count in shards} == shards


def test_the_published_crc32_check_value() -> None:
    """CRC-32's standard check: crc32("123456789") = 0xCBF43926 (= 3421780262)."""
    assert shard_of(b"123456789", 2**32) == 0xCBF43926
