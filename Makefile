# rmq_async developer commands. Every target installs what it needs into .venv by itself.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
PYTEST_ARGS ?=
# make test runs the suite on two pytest-xdist workers, a test file per worker at a time (so a
# module's broker fixture starts once). Two workers take 11 to 12 minutes on 2 cores (the
# machine's hour moves it) and keep both cores busy for most of it (idle about 15% of the
# pytest part): the suite's time is CPU, most of it JVM starts (brokers, name servers, Spark).
# PYTEST_WORKERS=0 runs it serially.
PYTEST_WORKERS ?= 2

.PHONY: setup test test-unit test-unit-pure lint demo broker-up broker-down broker-status bench bench-quick clean chaos docs

$(STAMP): pyproject.toml setup.py rmq_async/protocol/_cmessage.pyx
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,spark,bench,docs]'
	@touch $(STAMP)

setup: $(STAMP)
	$(PY) -m rmq_async.devbroker fetch

test: setup
	$(PY) -m pytest -ra -p no:cacheprovider --durations=25 -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)
	$(MAKE) --no-print-directory test-unit-pure
	$(MAKE) --no-print-directory docs

test-unit: $(STAMP)
	$(PY) -m pytest -ra -p no:cacheprovider -m "not broker and not spark" tests/unit $(PYTEST_ARGS)

# The unit tests again on the pure-Python decoder (the fallback where the extension is missing),
# on the same workers as make test (they are CPU-bound: two workers take 32 s where one took 55).
test-unit-pure: $(STAMP)
	RMQ_ASYNC_NO_EXTENSIONS=1 $(PY) -m pytest -ra -p no:cacheprovider -n $(PYTEST_WORKERS) -m "not broker and not spark" tests/unit $(PYTEST_ARGS)

# The chaos suite (tests/chaos) at full sizes: 100,000-message broker kill, 50,000-message
# retry storm, 200,000 messages of rebalance churn for 60 s. make test runs it at small sizes.
chaos: setup
	RMQ_CHAOS_FULL=1 $(PY) -m pytest -ra -p no:cacheprovider --durations=25 tests/chaos $(PYTEST_ARGS)

# The Spark source (tests/spark_source) at the acceptance sizes: a batch read of 200,000
# messages, a stream of 500,000 x 1 KiB with the driver killed mid-stream, 200,000 on a
# standalone cluster. make test runs them at small sizes.
.PHONY: test-spark-source-full
test-spark-source-full: setup
	RMQ_SPARK_SOURCE_FULL=1 $(PY) -m pytest -ra -p no:cacheprovider --durations=25 tests/spark_source $(PYTEST_ARGS)

# The local-cluster tests (tests/broker/test_local_cluster.py: two broker groups with a slave each,
# two name servers) at the acceptance sizes: 100,000 messages exactly once across both groups,
# 100,000 through a master kill. make test runs them at small sizes.
.PHONY: test-cluster
test-cluster: setup
	RMQ_CLUSTER_FULL=1 $(PY) -m pytest -ra -s -p no:cacheprovider --durations=25 tests/broker/test_local_cluster.py $(PYTEST_ARGS)

# One million generated inputs through the frame, header, JSON body and stored-record decoders
# (tests/fuzz/fuzz_decoders.py; make test runs 20,000 of them in tests/unit/test_fuzz_smoke.py).
.PHONY: fuzz
fuzz: $(STAMP)
	$(PY) -m tests.fuzz.fuzz_decoders --inputs 1000000 --seed 0

# The compatibility subset (tests/compat: delivery and commit, retry and DLQ, tags, orderly,
# broadcasting, reset offset by time, ACL) on every supported broker version. make test runs it
# on 4.9.7 only (next to the full suite on 5.3.3).
COMPAT_VERSIONS ?= 4.9.7,5.1.4,5.3.3
.PHONY: test-compat
test-compat: setup
	RMQ_COMPAT_VERSIONS=$(COMPAT_VERSIONS) $(PY) -m pytest -ra -p no:cacheprovider --durations=25 tests/compat $(PYTEST_ARGS)

# The documentation site (MkDocs Material + mkdocstrings) into site/, warnings as errors.
# Its code examples (docs/examples) run as tests in tests/broker/test_docs_examples.py.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet --site-dir site

lint: $(STAMP)
	$(PY) -m ruff check rmq_async tests benchmarks examples docs/examples
	$(PY) -m mypy

demo: setup
	$(PY) examples/demo.py

broker-up: setup
	$(PY) -m rmq_async.devbroker up

broker-down: $(STAMP)
	$(PY) -m rmq_async.devbroker down

broker-status: $(STAMP)
	$(PY) -m rmq_async.devbroker status

bench: setup
	$(PY) benchmarks/run.py

bench-quick: setup
	$(PY) benchmarks/run.py --quick

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build *.egg-info site
	rm -f rmq_async/protocol/_cmessage.c rmq_async/protocol/*.so
