# Everything a fresh clone needs: Python 3.11+, Java 17+ and Maven on the machine.
#   make up    - start a local Kafka (KRaft) and three store nodes on loopback; print endpoints and examples
#   make test  - virtualenv, project + dev tools, Kafka and Spark jars, lint, the whole test suite
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PROTOS := $(shell find proto -name '*.proto')

.PHONY: up test unit lint proto kafka spark venv bench-quick clean

up: venv proto kafka
	$(PY) -m kvstore.dev.cluster --data-dir .data

test: venv proto kafka spark lint
	$(PY) -m pytest -q $(PYTEST_ARGS)

unit: venv proto
	$(PY) -m pytest -q tests/unit

lint: venv proto
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

# Stubs are generated next to their packages (wal/v1, kvstore/v1) and never committed.
proto: venv
	$(PY) -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. $(PROTOS)

kafka: venv
	$(PY) -m wal.broker fetch

# Spark's Kafka connector (Maven Central) and the pipeline's WAL decoders (javac), for kvstore.pipeline.
spark: venv proto
	$(PY) -m kvstore.pipeline.jars fetch

bench-quick: venv proto kafka spark
	$(PY) -m pip install -q -e '.[dev,bench]'
	$(PY) bench/wal_append.py --quick
	$(PY) bench/kv.py --quick
	$(PY) bench/failover.py --quick
	$(PY) bench/pipeline.py --quick

clean:
	rm -rf $(VENV) .data build *.egg-info
	find . -name '*_pb2*.py*' -not -path './.venv/*' -delete
