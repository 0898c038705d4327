"""The JVM side of the pipeline: Spark's Kafka connector from Maven Central, and our WAL decoders.

pyspark ships Spark itself (with Scala, Hadoop and slf4j); the pipeline adds, through
`spark.jars`, the jars `jvm/pom.xml` resolves (spark-sql-kafka-0-10 with kafka-clients and
commons-pool2, and protobuf-java) and `kvstore-pipeline.jar`, compiled here with javac against
pyspark's own jars: the decoders of `jvm/src` plus the descriptor set of the WAL's messages,
taken from the stubs the build generated from proto/ (so the JVM decodes exactly the schema
Python does, and an installed package needs no protoc).

    python -m kvstore.pipeline.jars fetch      (make spark; idempotent, ~10 s the first time)

Everything lands in $KVSTORE_SPARK_HOME, else ~/.cache/kvstore/spark-<version>. A stamp holding a
hash of the pom, the Java sources and the protos marks a complete build, so a change to any of
them rebuilds and a fresh clone needs only Maven and a JDK.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SPARK_VERSION = "4.2.0"  # pinned: pyspark in pyproject.toml and the connector must agree
_HERE = Path(__file__).resolve().parent
POM = _HERE / "jvm" / "pom.xml"
JAVA_SOURCES = _HERE / "jvm" / "src" / "main" / "java"
DECODER_JAR = "kvstore-pipeline.jar"


class JarsError(RuntimeError):
    """The pipeline's jars could not be fetched or built."""


def cache_dir() -> Path:
    env = os.environ.get("KVSTORE_SPARK_HOME")
    return Path(env) if env else Path.home() / ".cache" / "kvstore" / f"spark-{SPARK_VERSION}"


def descriptor_set() -> bytes:
    """The WAL's two message types (wal.v1.Record, kvstore.internal.v1.WalEntry) as a FileDescriptorSet."""
    from google.protobuf import descriptor_pb2

    from kvstore.internal.v1 import wal_entry_pb2
    from wal.v1 import record_pb2

    files = descriptor_pb2.FileDescriptorSet()
    for module in (record_pb2, wal_entry_pb2):  # neither imports another .proto
        files.file.add().MergeFromString(module.DESCRIPTOR.serialized_pb)
    return files.SerializeToString(deterministic=True)


def _inputs_hash() -> str:
    h = hashlib.sha256(SPARK_VERSION.encode() + descriptor_set())
    for path in [POM, *sorted(JAVA_SOURCES.rglob("*.java"))]:
        h.update(str(path.relative_to(_HERE)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def jar_paths() -> list[Path]:
    """The jars to hand to `spark.jars`, fetching and building them if needed."""
    root = fetch()
    return [*sorted((root / "libs").glob("*.jar")), root / DECODER_JAR]


def fetch(quiet: bool = True) -> Path:
    """Resolve the connector and build the decoders (idempotent; the stamp marks success)."""
    root = cache_dir()
    stamp = root / ".complete"
    want = _inputs_hash()
    if stamp.exists() and stamp.read_text().strip() == want and (root / DECODER_JAR).exists():
        return root
    for tool in ("mvn", "javac", "jar"):
        if shutil.which(tool) is None:
            raise JarsError(f"{tool} is required to build the Spark pipeline's jars (Maven and a JDK 17+)")
    root.mkdir(parents=True, exist_ok=True)
    libs = root / "libs"
    if libs.exists():
        shutil.rmtree(libs)
    cmd = ["mvn", "-B", "-f", str(POM), f"-Dspark.version={SPARK_VERSION}", "dependency:copy-dependencies",
           "-DincludeScope=runtime", f"-DoutputDirectory={libs}"]
    if quiet:
        cmd.insert(1, "-q")
    if subprocess.run(cmd, check=False).returncode != 0:
        raise JarsError(f"mvn failed resolving Spark's Kafka connector {SPARK_VERSION}")
    _drop_shipped(libs)
    _build_decoders(root, libs)
    stamp.write_text(want + "\n")
    return root


def _pyspark_jars() -> Path:
    import pyspark

    return Path(pyspark.__file__).resolve().parent / "jars"


def _artifact(jar: Path) -> str:
    """`lz4-java-1.10.1.jar` -> `lz4-java`."""
    return re.sub(r"-\d[^-]*(-[A-Za-z0-9]+)?\.jar$", "", jar.name)


def _drop_shipped(libs: Path) -> None:
    """Remove what pyspark already ships (lz4, snappy, spark-tags, ...): two versions of one
    library on a classpath is a lottery."""
    shipped = {_artifact(j) for j in _pyspark_jars().glob("*.jar")}
    for jar in libs.glob("*.jar"):
        if _artifact(jar) in shipped:
            jar.unlink()


def _build_decoders(root: Path, libs: Path) -> None:
    spark_jars = _pyspark_jars()  # the jars Spark itself runs on: compile against exactly those
    protobuf = sorted(libs.glob("protobuf-java-*.jar"))
    if not protobuf:
        raise JarsError(f"protobuf-java missing from {libs}")
    with tempfile.TemporaryDirectory(prefix="kvstore-jvm-") as tmp:
        classes = Path(tmp) / "classes"
        classes.mkdir()
        (classes / "kvstore-wal.desc").write_bytes(descriptor_set())
        classpath = os.pathsep.join([str(spark_jars / "*"), str(protobuf[0])])
        sources = [str(p) for p in sorted(JAVA_SOURCES.rglob("*.java"))]
        _run(["javac", "--release", "17", "-nowarn", "-cp", classpath, "-d", str(classes), *sources], "javac")
        tmp_jar = root / (DECODER_JAR + ".tmp")
        _run(["jar", "--create", "--file", str(tmp_jar), "-C", str(classes), "."], "jar")
        tmp_jar.replace(root / DECODER_JAR)


def _run(cmd: list[str], what: str) -> None:
    result = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if result.returncode != 0:
        raise JarsError(f"{what} failed ({result.returncode}): {result.stderr.strip()[-2000:]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvstore.pipeline.jars", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["fetch", "path"])
    args = parser.parse_args(argv)
    try:
        if args.command == "fetch":
            print(fetch(quiet=True))
        else:
            print(",".join(str(p) for p in jar_paths()))
    except JarsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
