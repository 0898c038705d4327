"""One place that builds the pipeline's SparkSession: local by default, any cluster by `--master`.

The jobs never assume where they run: `local[*]` on a laptop, or `spark://host:7077`,
`k8s://...`, `yarn` by passing a master (and, for a cluster, `--conf` settings such as executor
memory). The jars (`kvstore.pipeline.jars`) go through `spark.jars`, which Spark ships to every
executor. For local masters the driver binds loopback only and the web UI stays off.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from pyspark.sql import SparkSession

from kvstore.pipeline import jars

DEFAULT_MASTER = "local[*]"
DEFAULT_DRIVER_MEMORY = "1g"

RECORD_UDF = "kv_decode_record"
ENTRY_UDF = "kv_decode_entry"
RECORD_TYPE = "struct<expected_offset:bigint,writer_id:string,writer_term:bigint,payload:binary>"
ENTRY_TYPE = ("struct<request_id:string,effects:array<struct<kind:string,key:binary,value:binary>>,"
              "response:binary,leader_unix_ms:bigint,txn:struct<kind:string,txn_id:string,commit:boolean,"
              "succeeded:boolean,coordinator:int,participants:array<int>,records:int,txn_ids:array<string>>>")


def parse_conf(pairs: list[str] | None) -> dict[str, str]:
    """`--conf k=v` pairs, as spark-submit takes them."""
    out: dict[str, str] = {}
    for pair in pairs or ():
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--conf takes KEY=VALUE, got {pair!r}")
        out[key.strip()] = value
    return out


def spark_session(master: str | None = None, *, app_name: str = "kvstore-pipeline",
                  conf: Mapping[str, str] | None = None) -> SparkSession:
    """A session with the Kafka connector and the WAL decoders registered.

    Spark allows one active session per process; a second call returns the same session (its
    master and jars fixed by the first), which is what the tests want.
    """
    master = master or os.environ.get("KVSTORE_SPARK_MASTER") or DEFAULT_MASTER
    # Executors run the jobs' Python parts (the shard fold) in this interpreter's environment.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    builder = (SparkSession.builder.appName(app_name).master(master)
               .config("spark.jars", ",".join(str(p) for p in jars.jar_paths()))
               .config("spark.driver.memory", DEFAULT_DRIVER_MEMORY)
               .config("spark.sql.session.timeZone", "UTC")
               .config("spark.sql.shuffle.partitions", "8")
               .config("spark.sql.execution.arrow.pyspark.enabled", "true")
               # Spark's progress bar on a terminal (stderr), between the commands' own phase lines;
               # never into a log file or a pipe.
               .config("spark.ui.showConsoleProgress", "true" if sys.stderr.isatty() else "false"))
    if master.startswith("local"):
        # Spark resolves the host name to pick its address and warns when that is loopback.
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        builder = (builder.config("spark.driver.host", "127.0.0.1")
                   .config("spark.driver.bindAddress", "127.0.0.1")
                   .config("spark.ui.enabled", "false"))
    for key, value in (conf or {}).items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel(os.environ.get("KVSTORE_SPARK_LOG_LEVEL", "WARN"))
    spark.udf.registerJavaFunction(RECORD_UDF, "dev.kvstore.pipeline.WalDecoders$DecodeRecord", RECORD_TYPE)
    spark.udf.registerJavaFunction(ENTRY_UDF, "dev.kvstore.pipeline.WalDecoders$DecodeEntry", ENTRY_TYPE)
    return spark
