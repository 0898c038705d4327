# The store node image: `kvstore serve`, configured by KVSTORE_* environment variables
# (kvstore/node.py NodeConfig). Used by docker-compose.yml; kept correct by tests/unit/test_compose.py.
#
# Two stages on the same base (the virtualenv is copied from one to the other, so the Python
# paths must match): `build` installs the dependencies, generates the gRPC stubs from proto/
# (as `make proto` does) and installs the project with them; the final stage holds only the
# virtualenv, runs as an unprivileged user and keeps its LevelDB directory in /data.

FROM python:3.11-slim-bookworm AS build

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

# plyvel publishes manylinux wheels for x86_64 only; on other architectures (arm64: Apple
# silicon, Graviton) pip compiles it against the system LevelDB.
RUN if [ "$(dpkg --print-architecture)" != "amd64" ]; then \
        apt-get update \
        && apt-get install -y --no-install-recommends g++ libleveldb-dev \
        && rm -rf /var/lib/apt/lists/*; \
    fi

RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src

# Dependencies first, in a layer that survives code changes: the runtime ones and grpcio-tools,
# with the version ranges pyproject.toml gives (installed together, so the stub generator and the
# grpcio/protobuf runtime are resolved to versions that accept each other's generated code).
COPY pyproject.toml ./
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
        print(*p['dependencies'], *[d for d in p['optional-dependencies']['dev'] if d.startswith('grpcio-tools')], \
              sep='\n')" > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt

COPY README.md ./
COPY proto/ proto/
COPY wal/ wal/
COPY kvstore/ kvstore/

# The stubs are generated next to their packages (wal/v1, kvstore/v1) before the project is
# installed, so the installed packages contain them; .dockerignore keeps any local ones out.
RUN python -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. $(find proto -name '*.proto') \
    && pip install --no-deps . \
    && pip uninstall -y grpcio-tools \
    && pip check


FROM python:3.11-slim-bookworm

# Where plyvel was compiled (not amd64) it links the system LevelDB at run time.
RUN if [ "$(dpkg --print-architecture)" != "amd64" ]; then \
        apt-get update \
        && apt-get install -y --no-install-recommends libleveldb1d \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && useradd --system --uid 10001 --user-group --home-dir /data --no-create-home kvstore \
    && mkdir /data \
    && chown kvstore:kvstore /data

COPY --from=build /opt/venv /opt/venv

ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    KVSTORE_LISTEN=0.0.0.0:50051 \
    KVSTORE_DATA_DIR=/data

USER kvstore
WORKDIR /data

# Fail the build, not the first start, if a module or a generated stub is missing.
RUN python -c "import kvstore.server, kvstore.cli, kvstore.v1.kv_pb2_grpc, wal.v1.record_pb2" \
    && kvstore serve --help > /dev/null

EXPOSE 50051

# Exec form: the node is PID 1 and gets SIGTERM itself (it hands its shards over, finishes the
# batches in flight, then exits).
CMD ["kvstore", "serve"]
