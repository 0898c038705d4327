"""The change feed: the store's accepted operations as a Parquet table, exactly once (docs/design.md §8).

Why Structured Streaming rather than a batch job with bookkeeping of our own: Spark's file sink
and its checkpoint already give exactly once into a table. A micro-batch's offsets are logged
before it runs, its files are listed in the sink's `_spark_metadata` log when it commits, and a
batch that died halfway is re-run with the same offsets while its stray files stay unlisted. So
the table must be read through Spark (which honours `_spark_metadata`), never by listing Parquet
files. The same code serves a one-off run (`availableNow`: everything committed now, then stop;
the next run continues there) and `--follow`.

Rows are what the store applies, computed from the same W3 column expression as every other job
(`wal_source.judged`): one row per effect of an accepted record whose payload is a WalEntry,
revision = the record's offset (`kvstore.core.state`). Rogue and malformed records give no rows.

Truncation (`kvstore wal truncate`, Kafka delete_records) must not remove records a feed has not
read yet, so the feed registers itself as a WAL reader (`wal.readers`, name `changes:<checkpoint>`)
with, per shard, the next offset it may still need, and truncation stops there. That position
may lag, never lead: it is the start of the micro-batch about to run, i.e. the end offsets of the
last *committed* batch. Structured Streaming writes `offsets/N` before batch N runs and
`commits/N` after; a batch planned but not committed is re-run from its start after a crash, so
its start must stay protected, and it does: the position only moves when a batch's progress is
reported, which Spark does after `commits/N` is written (`MicroBatchExecution`: runBatch ends
with markMicroBatchEnd, the commit log, before finishTrigger reports progress). A new feed
registers its starting offsets (the log starts) before its first batch; a resumed one registers
the last committed batch's end offsets from its checkpoint before it starts (or, if those cannot
be read, the log starts: never ahead). Updates come from the driver's wait loop reading
`query.lastProgress`, not from a StreamingQueryListener (a Python listener runs on Spark's
listener-bus thread through a py4j callback, where Kafka I/O would stall the bus and an error
would vanish) nor foreachBatch (it would replace the file sink and its exactly-once log). A
failed update leaves the older, safe position, and is retried at the next batch. The
registration stays after a run: the feed continues next time. `kvstore wal readers remove`
deregisters an abandoned feed.

`failOnDataLoss` stays true: if the WAL was truncated under the feed anyway (`--force`, a feed
that predates the registry), a feed with a hole is worse than a stopped one, and the hole cannot
be filled later (the records are gone), so the refusal says to start a new table. A *new* feed on
a truncated WAL starts at each shard's log start, and says that older history is gone.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from types import FrameType
from typing import TYPE_CHECKING, Any

from pyspark.errors import StreamingQueryException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import (
    BinaryType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from kvstore.output import Printer
from kvstore.pipeline import commands
from kvstore.pipeline.errors import PipelineError, WalGapError
from kvstore.pipeline.target import WalTarget
from kvstore.pipeline.wal_source import accepted, entries, judged, kafka_options, read_wal

if TYPE_CHECKING:
    from pyspark.sql.streaming.query import StreamingQuery

    from wal.readers import ReaderRegistry

CHANGES_SCHEMA = StructType([
    StructField("shard", IntegerType()),
    StructField("offset", LongType()),
    StructField("effect_index", IntegerType()),
    StructField("revision", LongType()),
    StructField("key", BinaryType()),
    StructField("value", BinaryType()),  # NULL for deletes; a put of b"" is b""
    StructField("op", StringType()),  # 'put' | 'delete'
    StructField("request_id", StringType()),  # NULL when the entry has none
    StructField("writer", StringType()),
    StructField("term", LongType()),
    StructField("timestamp", TimestampType()),  # the Kafka record's time
    StructField("leader_unix_ms", LongType()),  # 0: written before WalEntry had it
    # The cross-shard transaction whose record applied this effect (docs/design.md §10): a
    # participant's resolve, or the coordinator's commit decision (its own part); NULL for any other
    # write. A consumer groups a transaction's rows, over every shard, by it.
    StructField("txn_id", StringType()),
])
CHANGES_COLUMNS = tuple(f.name for f in CHANGES_SCHEMA.fields)
PARTITION_COLUMN = "shard"
CHECKPOINT_DIR = "_checkpoint"
SINK_LOG_DIR = "_spark_metadata"  # the file sink's commit log (Spark's name)
TIMESTAMP_TYPE_CONF = "spark.sql.parquet.outputTimestampType"
STOP_TIMEOUT_CONF = "spark.sql.streaming.stopTimeout"
STOP_TIMEOUT_MS = 60_000  # Kafka fetches of the running batch are interrupted; this is ample
WAIT_STEP_S = 1  # how long one wait on the query blocks: Ctrl-C and progress are noticed this often
READER_KIND = "change-feed"  # the feed's kind in the WAL readers registry (`kvstore wal readers`)


def changes_frame(judged_frame: DataFrame) -> DataFrame:
    """One row per effect of each accepted, well-formed entry (CHANGES_SCHEMA), in any order.

    Only column expressions and posexplode, so it runs on a streaming frame as on a batch one,
    and in the JVM (no Python worker per row). An entry with no effects has nothing to show.
    """
    decoded = entries(accepted(judged_frame)).where(F.col("entry").isNotNull())
    exploded = decoded.select(
        "shard", "offset", "timestamp_ms", "writer_id", "writer_term",
        F.col("entry.request_id").alias("request_id"),
        F.col("entry.leader_unix_ms").alias("leader_unix_ms"),
        F.when(F.col("entry.txn.kind").isin("resolve", "decision"), F.col("entry.txn.txn_id")).alias("txn_id"),
        F.posexplode(F.col("entry.effects")).alias("effect_index", "effect"),
    )
    return exploded.select(
        F.col("shard").cast("int").alias("shard"),
        F.col("offset").cast("bigint").alias("offset"),
        F.col("effect_index").cast("int").alias("effect_index"),
        F.col("offset").cast("bigint").alias("revision"),
        F.col("effect.key").alias("key"),
        F.col("effect.value").alias("value"),
        F.col("effect.kind").alias("op"),
        F.nullif(F.col("request_id"), F.lit("")).alias("request_id"),
        F.col("writer_id").alias("writer"),
        F.col("writer_term").alias("term"),
        F.timestamp_millis(F.col("timestamp_ms")).alias("timestamp"),
        F.col("leader_unix_ms").cast("bigint").alias("leader_unix_ms"),
        F.col("txn_id"),
    )


def read_changes(spark: SparkSession, target: WalTarget, ranges: Mapping[int, tuple[int, int]]) -> DataFrame:
    """The feed's rows for [start, end) per shard, as a batch: for audits and tests, which want
    a bounded answer and no checkpoint."""
    return changes_frame(judged(read_wal(spark, target.bootstrap_servers, target.topic, ranges,
                                         security=target.security)))


def read_table(spark: SparkSession, to: str) -> DataFrame:
    """The feed's table as written so far (committed batches only), columns in CHANGES_COLUMNS
    order. The schema is given, not inferred: a feed whose batches were all empty has no file to
    infer it from."""
    return spark.read.schema(CHANGES_SCHEMA).parquet(to).select(*CHANGES_COLUMNS)


@dataclasses.dataclass(frozen=True)
class FeedRun:
    rows: int  # rows this run added to the table
    resumed: bool  # False: this run started the feed
    first_offsets: dict[int, int] | None  # a new feed on a truncated WAL: where each shard's history begins


def checkpoint_of(to: str, checkpoint: str | None) -> str:
    return checkpoint or f"{to.rstrip('/')}/{CHECKPOINT_DIR}"


def _absolute(uri: str) -> str:
    """A local path made absolute (two shells in other directories name the same feed alike);
    a URI as given."""
    if "://" in uri or uri.startswith("file:"):
        return uri.rstrip("/")
    return os.path.abspath(uri)


def reader_name(checkpoint: str) -> str:
    """The feed's name in the WAL readers registry: its checkpoint, which is what a feed is (its
    position lives there, and two feeds never share one)."""
    return f"changes:{_absolute(checkpoint)}"


def source_offsets(offsets_json: str | None, topic: str) -> dict[int, int] | None:
    """Per partition of `topic`, the offsets in the Kafka source's JSON form
    (`{"<topic>": {"<partition>": <offset>, ...}}`, as in a progress report's endOffset and in
    the checkpoint's offset log), or None if it holds none for `topic`. Pure."""
    if not offsets_json:
        return None
    try:
        body = json.loads(offsets_json)
    except ValueError:
        return None
    partitions = body.get(topic) if isinstance(body, dict) else None
    if not isinstance(partitions, dict) or not partitions:
        return None
    out: dict[int, int] = {}
    for partition, offset in partitions.items():
        if not (isinstance(partition, str) and partition.isdigit()) or isinstance(offset, bool) \
                or not isinstance(offset, int) or offset < 0:
            return None  # -1/-2 (latest/earliest) are not positions
        out[int(partition)] = offset
    return out


def next_positions(recorded: Mapping[int, int], reported: Mapping[int, int] | None) -> dict[int, int] | None:
    """The positions to record after a progress report, or None if nothing changes. A shard the
    report does not mention keeps its recorded position (never dropped: dropping it would stop
    protecting it). Pure."""
    if reported is None:
        return None
    merged = {s: reported.get(s, o) for s, o in recorded.items()}
    merged.update({s: o for s, o in reported.items() if s not in merged})
    return merged if merged != dict(recorded) else None


class _Registration:
    """The feed's entry in the WAL readers registry, kept at the start of the next batch."""

    def __init__(self, target: WalTarget, name: str, where: str, timeout_s: float,
                 say: Callable[[str], None]) -> None:
        from wal import ReaderRegistry

        self.name = name
        self._target = target
        self._where = where
        self._say = say
        self._registry: ReaderRegistry = ReaderRegistry(target.bootstrap_servers, target.topic,
                                                        security=target.security, timeout_s=timeout_s)
        self.positions: dict[int, int] = {}
        self._failing = False

    def start(self, positions: Mapping[int, int]) -> None:
        """Before the query starts; PipelineError if it cannot be recorded (the feed would be
        unprotected from its first batch on)."""
        from wal import RegistryError

        try:
            self._record(positions)
        except RegistryError as exc:
            raise PipelineError(f"cannot register the change feed as a WAL reader, so truncation could delete "
                                f"what it has not read: {exc}; nothing was run") from exc

    def follow(self, query: StreamingQuery) -> None:
        """Record the end offsets of the last committed batch, if they moved. A failure leaves
        the older (safe) position and is said once; the next batch tries again."""
        from wal import RegistryError

        progress = query.lastProgress
        if progress is None or not progress.sources:
            return
        reported = source_offsets(progress.sources[0].endOffset, self._target.topic)
        positions = next_positions(self.positions, reported)
        if positions is None:
            return
        try:
            self._record(positions)
        except RegistryError as exc:
            if not self._failing:
                self._say(f"WARNING: cannot update the feed's WAL reader position (truncation still stops at the "
                          f"older one): {exc}")
            self._failing = True
            return
        self._failing = False

    def close(self) -> None:
        self._registry.close()

    def _record(self, positions: Mapping[int, int]) -> None:
        from wal import Reader

        self._registry.record(Reader(self.name, READER_KIND, self._where, dict(positions), int(time.time() * 1000)))
        self.positions = dict(positions)


def run_feed(spark: SparkSession, target: WalTarget, to: str, *, checkpoint: str | None = None,
             follow: bool = False, interval_s: float = 5.0, timeout_s: float = 30.0,
             notice: Callable[[str], None] | None = None) -> FeedRun:
    """Append what the WAL committed since the last run to the table at `to`; with `follow`,
    keep doing so every `interval_s` until Ctrl-C (SIGINT), which stops the query between or
    inside a batch (an interrupted batch is re-run by the next run, exactly once).

    Without `follow`, Ctrl-C raises KeyboardInterrupt once the query has stopped: the run did
    not finish what it was asked. `notice` gets the human remarks (history gone, batch progress).
    """
    assert interval_s > 0, f"interval must be > 0: {interval_s}"
    say = notice or (lambda text: print(f"kvstore: changes: {text}", file=sys.stderr))
    checkpoint = checkpoint_of(to, checkpoint)
    storage = _Storage(spark)
    resumed = storage.has_entries(f"{checkpoint}/commits")
    sink_started = storage.has_entries(f"{to.rstrip('/')}/{SINK_LOG_DIR}")
    if sink_started and not resumed and not storage.has_entries(f"{checkpoint}/offsets"):
        # The file sink skips batch ids it has already logged; a fresh checkpoint restarts at
        # batch 0, so its first batches would be dropped silently.
        raise PipelineError(f"{to} already holds a change feed, but its checkpoint {checkpoint} has no progress; "
                            "a new checkpoint there would silently skip rows. Pass the feed's own --checkpoint, "
                            "or start a new --to directory")
    if resumed and not sink_started:
        raise PipelineError(f"the checkpoint {checkpoint} has progress but the table {to} is missing (deleted?); "
                            "the feed would resume without its earlier rows. Start a new --to directory (and "
                            "checkpoint)")
    log_starts = _log_starts(target, timeout_s)
    first_offsets: dict[int, int] | None = None
    if not resumed and any(log_starts.values()):
        first_offsets = log_starts
        gone = ", ".join(f"shard {s} below {o}" for s, o in sorted(log_starts.items()) if o)
        say(f"the WAL was truncated ({gone}): this new feed starts at the log start; the history before it is "
            "gone (the newest snapshot holds the state as of its cut)")
    before = _sink_files(spark, to) if sink_started else set()
    registration = _Registration(target, reader_name(checkpoint), _absolute(to), timeout_s, say)
    try:
        starting = storage.committed_offsets(checkpoint, target.topic) if resumed else None
        if resumed and starting is None:
            say("the checkpoint's last committed offsets cannot be read; registering the log starts as this "
                "feed's position until its first batch commits")
        # Every shard listed: one the checkpoint lacks is protected from its log start.
        registration.start({**log_starts, **(starting or {})})
        with _CtrlC() as ctrl_c:
            query = _start(spark, target, to, checkpoint, log_starts, follow=follow, interval_s=interval_s)
            try:
                _wait(query, ctrl_c, follow=follow, say=say, registration=registration)
            except StreamingQueryException as exc:
                raise _failure(exc, target, to, log_starts, resumed, timeout_s) from exc
            finally:
                _stop(spark, query)
                registration.follow(query)  # the last batch that committed before the stop
            failed = query.exception()  # a failure racing Ctrl-C must not pass for a clean stop
            if failed is not None:
                raise _failure(failed, target, to, log_starts, resumed, timeout_s) from failed
            if ctrl_c.pressed and not follow:
                raise KeyboardInterrupt
    finally:
        registration.close()
    after = _sink_files(spark, to)
    return FeedRun(_count_rows(spark, after - before), resumed, first_offsets)


def command(args: argparse.Namespace, target: WalTarget | None, printer: Printer) -> int:
    """`kvstore changes --to DIR [--follow] [--checkpoint DIR] [--interval S]`."""
    assert target is not None, "changes reads the WAL"
    if args.interval <= 0:
        raise PipelineError(f"--interval must be > 0 seconds, got {args.interval}")
    spark = commands.spark_for(args, "kvstore-changes")
    run = run_feed(spark, target, args.to, checkpoint=args.checkpoint, follow=args.follow,
                   interval_s=args.interval, timeout_s=max(float(args.timeout), 10.0))
    if printer.json:
        record: dict[str, Any] = {"rows": run.rows, "to": args.to}
        if run.first_offsets is not None:
            record["first_offsets"] = {str(s): o for s, o in sorted(run.first_offsets.items())}
        printer.record(record)
    else:
        how = "continued" if run.resumed else "started"
        printer.line(f"{run.rows} change rows added to {args.to} (feed {how})")
    return 0


def _start(spark: SparkSession, target: WalTarget, to: str, checkpoint: str, log_starts: Mapping[int, int], *,
           follow: bool, interval_s: float) -> StreamingQuery:
    # startingOffsets only counts for a new checkpoint; a resumed query goes on from its own.
    starting = {target.topic: {str(s): o for s, o in sorted(log_starts.items())}}
    source = (spark.readStream.format("kafka").options(**kafka_options(target.bootstrap_servers,
                                                                        security=target.security))
              .option("assign", json.dumps({target.topic: sorted(log_starts)}))
              .option("startingOffsets", json.dumps(starting))
              .option("failOnDataLoss", "true")
              .load())
    writer = (changes_frame(judged(source)).writeStream.format("parquet")
              .option("path", to).option("checkpointLocation", checkpoint)
              .partitionBy(PARTITION_COLUMN).outputMode("append"))
    if follow:
        writer = writer.trigger(processingTime=f"{max(1, round(interval_s * 1000))} milliseconds")
    else:
        writer = writer.trigger(availableNow=True)
    # Parquet's standard timestamp rather than Spark's legacy INT96, for the table's other
    # readers, and a bounded stop. The query copies the session's settings when it starts, so
    # the session (shared with other jobs in this process) is set only for that moment.
    with _session_conf(spark, {TIMESTAMP_TYPE_CONF: "TIMESTAMP_MICROS", STOP_TIMEOUT_CONF: str(STOP_TIMEOUT_MS)}):
        return writer.start()


def _wait(query: StreamingQuery, ctrl_c: _CtrlC, *, follow: bool, say: Callable[[str], None],
          registration: _Registration | None = None) -> None:
    """Until the query ends (availableNow: all done; follow: never by itself) or Ctrl-C, in
    short waits, so that Ctrl-C is noticed between two calls into the JVM, and the feed's
    registered position follows its committed batches."""
    reported = -1
    while not query.awaitTermination(WAIT_STEP_S) and not ctrl_c.pressed:
        if registration is not None:
            registration.follow(query)
        if follow:
            progress = query.lastProgress
            if progress is not None and progress.batchId > reported and progress.numInputRows > 0:
                reported = progress.batchId
                say(f"batch {progress.batchId}: {progress.numInputRows} WAL records read")


def _stop(spark: SparkSession, query: StreamingQuery) -> None:
    """Stop and wait for the query's thread, bounded: Spark waits without limit by default.
    An interrupted batch is not committed; the next run does it again, exactly once."""
    if not query.isActive:
        return
    try:
        # Set here as well as at start: whichever copy of the settings stop() reads, it is bounded.
        with _session_conf(spark, {STOP_TIMEOUT_CONF: str(STOP_TIMEOUT_MS)}):
            query.stop()
    except Exception as exc:
        if isinstance(exc, StreamingQueryException):
            return  # it failed meanwhile: query.exception() says how
        text = str(exc).strip()
        raise PipelineError(f"stopping the change feed query failed (bound {STOP_TIMEOUT_MS // 1000} s): "
                            f"{text.splitlines()[0] if text else type(exc).__name__}; the next run redoes its "
                            "unfinished batch") from exc


@contextlib.contextmanager
def _session_conf(spark: SparkSession, settings: Mapping[str, str]) -> Iterator[None]:
    """Set SQL settings for a moment; ones the user set (`--conf`) are left alone."""
    mine = [key for key in settings if spark.conf.get(key, None) is None]
    for key in mine:
        spark.conf.set(key, settings[key])
    try:
        yield
    finally:
        for key in mine:
            spark.conf.unset(key)


class _CtrlC:
    """Ctrl-C as a request to stop, honoured between two calls into the JVM.

    PySpark's own SIGINT handler cancels every job and raises KeyboardInterrupt wherever the
    main thread is: inside a py4j call that leaves the gateway connection half-used (a Py4JError
    instead of a clean stop). So while the query runs, the first Ctrl-C only sets a flag; a
    second one falls back to the previous handler, for a user who does not want to wait.
    Outside the main thread (no signals there) it does nothing.
    """

    def __init__(self) -> None:
        self.pressed = False
        self._previous: Any = None
        self._installed = False

    def __enter__(self) -> _CtrlC:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.getsignal(signal.SIGINT)
            signal.signal(signal.SIGINT, self._on_signal)
            self._installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous if self._previous is not None else signal.SIG_DFL)
            self._installed = False

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if not self.pressed:
            self.pressed = True
            return
        if callable(self._previous):
            self._previous(signum, frame)
        raise KeyboardInterrupt


def _failure(exc: StreamingQueryException, target: WalTarget, to: str, log_starts: Mapping[int, int],
             resumed: bool, timeout_s: float) -> PipelineError:
    text = str(exc)
    if "KAFKA_DATA_LOSS" in text or "data may have been lost" in text.lower() or "failOnDataLoss" in text:
        try:
            now = _log_starts(target, timeout_s)
        except PipelineError:
            now = dict(log_starts)
        starts = ", ".join(f"shard {s}: {o}" for s, o in sorted(now.items()))
        if resumed:
            return WalGapError(f"the change feed at {to} lost rows: the WAL {target.topic} was truncated below "
                               f"offsets it had not read yet (log starts now {starts}). The table cannot be "
                               "completed; start a new --to directory (it begins at the log start)")
        return WalGapError(f"the WAL {target.topic} was truncated while the new feed at {to} started (log starts now "
                           f"{starts}); remove {to} (and its checkpoint) and run again")
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return PipelineError(f"the change feed query failed: {first}")


def _log_starts(target: WalTarget, timeout_s: float) -> dict[int, int]:
    from confluent_kafka import KafkaException

    from wal.clients import PartitionEnds

    ends = PartitionEnds(target.bootstrap_servers, timeout_s, target.security)
    try:
        return {s: ends.log_start(target.topic, s) for s in range(target.shards)}
    except KafkaException as exc:
        raise PipelineError(f"log start of {target.topic}: {exc.args[0]}") from exc
    finally:
        ends.close()


def _sink_files(spark: SparkSession, to: str) -> set[str]:
    """The data files the sink has committed: listed from its log, so files of a batch that
    died halfway (and will be rewritten) are not among them."""
    return set(read_table(spark, to).inputFiles())


def _count_rows(spark: SparkSession, files: set[str]) -> int:
    if not files:
        return 0
    data_schema = StructType([f for f in CHANGES_SCHEMA.fields if f.name != PARTITION_COLUMN])
    return spark.read.schema(data_schema).parquet(*sorted(files)).count()


class _Storage:
    """Existence checks through Hadoop's FileSystem, so `--to` may be any URI Spark can write
    (s3a://, hdfs://, file:), not only a local path."""

    def __init__(self, spark: SparkSession) -> None:
        context = spark.sparkContext
        jvm = context._jvm
        assert jvm is not None, "a classic (not Spark Connect) session"
        self._jvm: Any = jvm
        self._conf: Any = context._jsc.hadoopConfiguration()

    def committed_offsets(self, checkpoint: str, topic: str) -> dict[int, int] | None:
        """The end offsets of the checkpoint's last committed batch (the start of the next one),
        or None if there is none or it cannot be read. Spark's logs: `commits/<N>` for each
        committed batch, `offsets/<N>` a version line, a metadata line, then one line per source
        with its offsets as JSON."""
        try:
            commits = self._jvm.org.apache.hadoop.fs.Path(f"{checkpoint.rstrip('/')}/commits")
            fs = commits.getFileSystem(self._conf)
            batches = [int(name) for status in fs.listStatus(commits)
                       if (name := status.getPath().getName()).isdigit()]
            if not batches:
                return None
            path = self._jvm.org.apache.hadoop.fs.Path(f"{checkpoint.rstrip('/')}/offsets/{max(batches)}")
            stream = fs.open(path)
            try:
                text = str(self._jvm.org.apache.commons.io.IOUtils.toString(stream, "UTF-8"))
            finally:
                stream.close()
        except Exception:  # py4j's errors of a missing or unreadable file: the caller falls back
            return None
        lines = [line for line in text.splitlines() if line.strip()]
        return source_offsets(lines[-1], topic) if len(lines) >= 3 else None

    def has_entries(self, uri: str) -> bool:
        """Whether the directory exists and holds a file that is not hidden (Spark's logs keep
        `.N.crc` and temporary files beside their entries)."""
        path = self._jvm.org.apache.hadoop.fs.Path(uri)
        fs = path.getFileSystem(self._conf)
        if not fs.exists(path) or not fs.getFileStatus(path).isDirectory():
            return False
        return any(not status.getPath().getName().startswith(".") for status in fs.listStatus(path))
