"""A producer outside the guard that writes any bytes, header keys included, for hostile-record tests.

confluent-kafka takes header keys as `str` (and encodes them as UTF-8), and so does the Java client,
so neither can write a key that is not UTF-8 or that holds a NUL byte. A WAL may still hold such
records (any Kafka client library, or a hand-made produce request, can write them), and every reader
must judge them as the others do (W3). This calls librdkafka's C API directly through ctypes, from
the copy that confluent-kafka's wheel ships (`confluent_kafka.libs`), with `rd_kafka_produceva`: no
variadic call, so ctypes can make it portably.

Test code only: nothing in the store writes the WAL except through the guard.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from pathlib import Path

import confluent_kafka

# rd_kafka_vtype_t (rdkafka.h)
_VTYPE_TOPIC = 1
_VTYPE_PARTITION = 3
_VTYPE_VALUE = 4
_VTYPE_HEADERS = 10
_PRODUCER = 0  # RD_KAFKA_PRODUCER
_ERRSTR_BYTES = 512
FLUSH_TIMEOUT_MS = 30_000

RawHeaders = Sequence[tuple[bytes, bytes | None]]


class _Mem(ctypes.Structure):
    _fields_ = [("ptr", ctypes.c_void_p), ("size", ctypes.c_size_t)]


class _Union(ctypes.Union):
    _fields_ = [("cstr", ctypes.c_char_p), ("i32", ctypes.c_int32), ("mem", _Mem), ("ptr", ctypes.c_void_p),
                ("_pad", ctypes.c_char * 64)]


class _Vu(ctypes.Structure):  # rd_kafka_vu_t
    _fields_ = [("vtype", ctypes.c_int), ("u", _Union)]


@functools.cache
def _library() -> ctypes.CDLL:
    libs = Path(confluent_kafka.__file__).resolve().parent.parent / "confluent_kafka.libs"
    candidates = sorted(libs.glob("librdkafka*.so*"))
    if not candidates:
        raise RuntimeError(f"no librdkafka in {libs}: this helper needs confluent-kafka's binary wheel")
    lib = ctypes.CDLL(str(candidates[0]))
    lib.rd_kafka_conf_new.restype = ctypes.c_void_p
    lib.rd_kafka_conf_set.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p,
                                      ctypes.c_size_t]
    lib.rd_kafka_new.restype = ctypes.c_void_p
    lib.rd_kafka_new.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
    lib.rd_kafka_headers_new.restype = ctypes.c_void_p
    lib.rd_kafka_headers_new.argtypes = [ctypes.c_size_t]
    lib.rd_kafka_headers_destroy.argtypes = [ctypes.c_void_p]
    lib.rd_kafka_header_add.restype = ctypes.c_int
    lib.rd_kafka_header_add.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_ssize_t, ctypes.c_char_p,
                                        ctypes.c_ssize_t]
    lib.rd_kafka_produceva.restype = ctypes.c_void_p
    lib.rd_kafka_produceva.argtypes = [ctypes.c_void_p, ctypes.POINTER(_Vu), ctypes.c_size_t]
    lib.rd_kafka_error_string.restype = ctypes.c_char_p
    lib.rd_kafka_error_string.argtypes = [ctypes.c_void_p]
    lib.rd_kafka_error_destroy.argtypes = [ctypes.c_void_p]
    lib.rd_kafka_flush.restype = ctypes.c_int
    lib.rd_kafka_flush.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.rd_kafka_outq_len.restype = ctypes.c_int
    lib.rd_kafka_outq_len.argtypes = [ctypes.c_void_p]
    lib.rd_kafka_destroy.argtypes = [ctypes.c_void_p]
    return lib


class RawProducer:
    """An idempotent, non-transactional librdkafka producer: records land as given, committed at once."""

    def __init__(self, bootstrap_servers: str, **settings: str) -> None:
        lib = _library()
        conf = lib.rd_kafka_conf_new()
        errstr = ctypes.create_string_buffer(_ERRSTR_BYTES)
        for key, value in {"bootstrap.servers": bootstrap_servers, "enable.idempotence": "true",
                           "linger.ms": "0", **settings}.items():
            if lib.rd_kafka_conf_set(conf, key.encode(), value.encode(), errstr, _ERRSTR_BYTES) != 0:
                raise ValueError(f"{key}={value}: {errstr.value.decode()}")
        handle = lib.rd_kafka_new(_PRODUCER, conf, errstr, _ERRSTR_BYTES)  # takes the conf
        if not handle:
            raise RuntimeError(f"rd_kafka_new: {errstr.value.decode()}")
        self._lib = lib
        self._rk: int | None = handle

    def produce(self, topic: str, partition: int, value: bytes | None, headers: RawHeaders = ()) -> None:
        """Queue one record; `flush` waits for it. Header keys and values are raw bytes."""
        assert self._rk is not None, "closed"
        lib = self._lib
        hdrs = lib.rd_kafka_headers_new(max(1, len(headers)))
        for key, header_value in headers:
            size = -1 if header_value is None else len(header_value)
            if lib.rd_kafka_header_add(hdrs, key, len(key), header_value, size) != 0:
                lib.rd_kafka_headers_destroy(hdrs)
                raise RuntimeError(f"rd_kafka_header_add refused {key!r}")
        vus = (_Vu * 4)()
        topic_bytes = topic.encode()
        vus[0].vtype, vus[0].u.cstr = _VTYPE_TOPIC, topic_bytes
        vus[1].vtype, vus[1].u.i32 = _VTYPE_PARTITION, partition
        buffer = ctypes.create_string_buffer(value, len(value)) if value is not None else None
        vus[2].vtype = _VTYPE_VALUE
        vus[2].u.mem = _Mem(ctypes.cast(buffer, ctypes.c_void_p) if buffer is not None else None,
                            len(value) if value is not None else 0)
        vus[3].vtype, vus[3].u.ptr = _VTYPE_HEADERS, hdrs  # librdkafka owns them once produced
        error = lib.rd_kafka_produceva(self._rk, vus, 4)  # copies the value (RD_KAFKA_MSG_F_COPY is the default)
        if error:
            text = lib.rd_kafka_error_string(error).decode()
            lib.rd_kafka_error_destroy(error)
            lib.rd_kafka_headers_destroy(hdrs)
            raise RuntimeError(f"produce to {topic}[{partition}]: {text}")

    def flush(self, timeout_ms: int = FLUSH_TIMEOUT_MS) -> None:
        assert self._rk is not None, "closed"
        self._lib.rd_kafka_flush(self._rk, timeout_ms)
        left = self._lib.rd_kafka_outq_len(self._rk)
        if left:
            raise TimeoutError(f"{left} records not delivered within {timeout_ms} ms")

    def close(self) -> None:
        if self._rk is not None:
            self._lib.rd_kafka_destroy(self._rk)
            self._rk = None

    def __enter__(self) -> RawProducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
