# rmq_async developer commands. Every target installs what it needs into .venv by itself.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
PYTEST_ARGS ?=
# make test runs the tests that need neither a broker nor Spark (most of their time is spent
# waiting on timers: four workers take 55 s where two took 77), on the compiled and then on the
# pure-Python path, then the tests on the real broker and Spark on three workers, each taking a
# whole file at a time (a module's broker fixture starts once), the files with the longest tests
# first (tests/scheduling.py), then builds the docs. The broker and Spark tests are mostly CPU
# (JVM starts), but a third worker fills the time the others wait: 508 s where two workers took
# 600 to 640. PYTEST_WORKERS=0 / UNIT_WORKERS=0 run them serially.
PYTEST_WORKERS ?= 3
UNIT_WORKERS ?= 4
# 1 where C extensions can be built here (a C compiler and Python's headers): the compiled
# codec must then have been built, and the unit tests fail if it is missing instead of running
# the pure path twice (setup.py turns a failed build into a warning, for machines without).
EXPECT_COMPILED = $(shell command -v $${CC:-cc} >/dev/null 2>&1 && $(PY) -c "import os, sysconfig; print(int(os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h'))))" 2>/dev/null || echo 0)

.PHONY: setup setup-test test test-unit test-unit-pure test-broker lint demo broker-up broker-down broker-status bench bench-quick clean chaos docs

$(STAMP): pyproject.toml setup.py rmq_async/protocol/_cmessage.pyx
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --no-compile -e '.[dev,spark,bench,docs]'
	@touch $(STAMP)

setup: $(STAMP)
	$(PY) -m rmq_async.devbroker fetch

# What make test needs besides: the 4.9.7 jars of the compatibility tests (tests/compat),
# fetched here and not inside a timed test's fixture.
setup-test: setup
	$(PY) -m rmq_async.devbroker fetch --version 4.9.7

# Every part runs even when one before it failed (a failing unit test must not hide what the
# broker tests would have found in the same run); make test fails if any part did, and names it.
test: setup-test
	@failed=""; \
	for part in test-unit test-unit-pure test-broker docs; do \
		$(MAKE) --no-print-directory $$part || failed="$$failed $$part"; \
	done; \
	if [ -n "$$failed" ]; then echo "make test: failed:$$failed"; exit 1; fi

# Every test that needs neither a broker nor Spark.
test-unit: $(STAMP)
	RMQ_ASYNC_EXPECT_COMPILED=$(EXPECT_COMPILED) $(PY) -m pytest -ra -p no:cacheprovider --durations=10 -n $(UNIT_WORKERS) -m "not broker and not spark" $(PYTEST_ARGS)

# The unit tests again on the pure-Python decoder (the fallback where the extension is missing).
test-unit-pure: $(STAMP)
	RMQ_ASYNC_NO_EXTENSIONS=1 $(PY) -m pytest -ra -p no:cacheprovider -n $(UNIT_WORKERS) -m "not broker and not spark" tests/unit $(PYTEST_ARGS)

# The tests on the real broker (and on local Spark): the rest of the suite.
test-broker: setup-test
	$(PY) -m pytest -ra -p no:cacheprovider --durations=25 -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "broker or spark" $(PYTEST_ARGS)

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
