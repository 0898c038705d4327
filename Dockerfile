# The store's image: `kvstore serve` (the default command), configured by KVSTORE_* environment
# variables (kvstore/server/config.py NodeConfig), and the Spark pipeline (`kvstore snapshot create`,
# `kvstore audit`, `kvstore wal truncate`, ...) on `local[*]`. Used by docker-compose.yml (the
# nodes and the one-shot `snapshot` service run this one image); kept correct by
# tests/unit/test_compose.py.
#
# Two stages on the same base (the virtualenv is copied from one to the other, so the Python
# paths must match): `build` installs the dependencies, installs the project (its build generates
# the gRPC stubs from proto/, setup.py, as `make proto` does) and builds the pipeline's jars (as
# `make spark` does) with a JDK and Maven; the final stage holds only the virtualenv, the built
# jars and a Java runtime, runs as an unprivileged user and keeps its LevelDB directory in /data.
#
# Size: the pipeline makes this image about five times larger than the node alone would need.
# pyspark is a core dependency (its wheel carries Spark's ~460 MB of jars; with pyarrow, pandas
# and numpy ~800 MB in the virtualenv) and Spark needs a Java 17 runtime (openjdk-17-jre-headless
# with its libraries, ~230 MB); the pipeline's own jars (kvstore/pipeline/jars.py: the Kafka
# connector, protobuf-java, the WAL decoders) add ~12 MB. Expect ~1.2 GB instead of ~0.2 GB
# (estimated from installed sizes; no image has been measured). The JDK, Maven and ~/.m2
# stay in the build stage. One image keeps the nodes and the jobs on the same code and
# the same WAL schema, which matters more here than the disk.

FROM python:3.11-slim-bookworm AS build

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    KVSTORE_SPARK_HOME=/opt/kvstore-spark

# plyvel publishes manylinux wheels for x86_64 only; on other architectures (arm64: Apple
# silicon, Graviton) pip compiles it against the system LevelDB.
RUN if [ "$(dpkg --print-architecture)" != "amd64" ]; then \
        apt-get update \
        && apt-get install -y --no-install-recommends g++ libleveldb-dev \
        && rm -rf /var/lib/apt/lists/*; \
    fi

# The pipeline's jars are built with javac (JDK 17: they are compiled --release 17, Spark 4's
# floor) and Maven (the Kafka connector from Maven Central). The slim image has no man
# directories, which the JDK's update-alternatives links into (its postinst has failed without them).
RUN mkdir -p /usr/share/man/man1 \
    && apt-get update \
    && apt-get install -y --no-install-recommends openjdk-17-jdk-headless maven \
    && rm -rf /var/lib/apt/lists/*

# A cache only: fill ~/.m2 with what the pom resolves (plugins included), in a layer that survives
# code changes, so the jars fetch below (the one that counts, with jars.py's own arguments) does
# not download them again on every rebuild.
COPY kvstore/pipeline/jvm/pom.xml /tmp/kvstore-pom.xml
RUN mvn -B -q -f /tmp/kvstore-pom.xml dependency:copy-dependencies -DincludeScope=runtime \
        -DoutputDirectory=/tmp/m2-warm \
    && rm -rf /tmp/m2-warm /tmp/kvstore-pom.xml

RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src

# Dependencies first, in a layer that survives code changes: the runtime ones, with the version
# ranges pyproject.toml gives (their floors are what the generated stubs check at import).
COPY pyproject.toml ./
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; x = p['optional-dependencies']; \
        print(*p['dependencies'], *[d for d in x['server'] + x['spark'] if not d.startswith('kvstore')], sep='\n')" \
        > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt

COPY setup.py MANIFEST.in README.md LICENSE CHANGELOG.md ./
COPY proto/ proto/
COPY wal/ wal/
COPY kvstore/ kvstore/

# The build generates the stubs next to their packages (wal/v1, kvstore/v1, kvstore/internal/v1)
# with the pinned grpcio-tools of [build-system] (setup.py; pip's isolated build environment), so
# the installed packages contain them; .dockerignore keeps any local ones out.
RUN pip install --no-deps . \
    && pip check

# The pipeline's jars into $KVSTORE_SPARK_HOME, built by the installed package (run from /, not
# /src, so `-m` imports it from the virtualenv): its pom and Java sources are package data, the
# WAL's descriptors come from its stubs, and javac compiles against its pyspark's jars. The stamp
# it writes hashes exactly those, so the final stage finds the build complete and never needs
# Maven (checked there).
RUN cd / && python -m kvstore.pipeline.jars fetch


FROM python:3.11-slim-bookworm

# Spark's Java runtime (pyspark starts `java` from PATH; update-alternatives puts it in
# /usr/bin, so JAVA_HOME, whose path differs per architecture, is not needed). Where plyvel was
# compiled (not amd64) it links the system LevelDB at run time. /snapshots belongs to the
# service user so a named volume mounted there starts out writable by it (Docker copies the
# image's directory, owner included, into an empty volume), like /data.
RUN mkdir -p /usr/share/man/man1 \
    && apt-get update \
    && apt-get install -y --no-install-recommends openjdk-17-jre-headless \
    && if [ "$(dpkg --print-architecture)" != "amd64" ]; then \
           apt-get install -y --no-install-recommends libleveldb1d; \
       fi \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --user-group --home-dir /data --no-create-home kvstore \
    && mkdir /data /snapshots \
    && chown kvstore:kvstore /data /snapshots

COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/kvstore-spark /opt/kvstore-spark

ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    KVSTORE_SPARK_HOME=/opt/kvstore-spark \
    KVSTORE_LISTEN=0.0.0.0:50051 \
    KVSTORE_DATA_DIR=/data

USER kvstore
WORKDIR /data

# Fail the build, not the first start, if a module or a generated stub is missing, or if the
# pipeline's jars are incomplete or stale (`jars path` would have to rebuild them, and this stage
# has no Maven: it fails).
RUN python -c "import kvstore.server.main, kvstore.cli, kvstore.v1.kv_pb2_grpc, wal.v1.record_pb2, kvstore.pipeline.session" \
    && kvstore serve --help > /dev/null \
    && kvstore snapshot --help > /dev/null \
    && java -version \
    && python -m kvstore.pipeline.jars path > /dev/null

# ... and if Spark does not start on this Java with those jars: a local session (which registers
# the WAL decoders, loading their classes) decodes one value and stops. The nodes never start
# Spark, so nothing else would notice before the first `docker compose run snapshot`. It costs a
# few seconds per build; it runs in /tmp, so Spark leaves nothing in /data.
RUN cd /tmp && SPARK_LOCAL_IP=127.0.0.1 KVSTORE_SPARK_LOG_LEVEL=ERROR python -c "\
from kvstore.pipeline.session import spark_session; \
spark = spark_session('local[1]', app_name='kvstore-image-check'); \
rows = spark.sql('SELECT kv_decode_record(CAST(NULL AS BINARY)) AS r').collect(); \
spark.stop(); \
assert rows[0].r is None, rows"

EXPOSE 50051

# Exec form: the node is PID 1 and gets SIGTERM itself (it hands its shards over, finishes the
# batches in flight, then exits).
CMD ["kvstore", "serve"]
