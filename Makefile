# The two set-up commands are `make demo` and `make test` (see README.md).
# Everything else here is a building block of those two.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.installed
# Debian packages the tests need: corosync (libcpg4, libquorum5, libvotequorum8
# come with it) for the real site bus, prometheus for promtool, and what
# python-qpid-proton's source build needs (gcc, headers, libssl-dev for TLS);
# systemd for systemd-analyze, -sysusers and -tmpfiles (tests/deploy, the units).
# nodejs and npm for rhea, the second AMQP 1.0 client of tests/interop (npm is
# looked for as a command: NodeSource's nodejs package carries it).
DEB_PKGS := corosync prometheus libssl-dev gcc python3-dev iproute2 procps systemd nodejs
RHEA     := lab/rhea/node_modules/.installed
PYTEST_ARGS ?=
# Python may cache bytecode here (pytest's rewritten tests too): a run that
# compiles every module again spends seconds before the first test.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: demo test check-fast fuzz lint typecheck pytest deb venv clean bench-resync bench-journal \
	bench-peer bench-cpu bench-wan bench-durable bench-deliver bench-analysis bench-ab chaos test-long

demo: deb $(STAMP)
	$(VENV)/bin/drgate demo

test: deb $(STAMP) lint typecheck pytest

# On both cores (pytest-xdist): nothing in the fast suite shares a port, a
# namespace or a lock.  The full suite (make test) stays serial: its e2e and
# corosync tests share the lab's namespaces.
check-fast: $(STAMP)
	$(VENV)/bin/pytest -q -n 2 -m "not slow and not corosync and not e2e and not spark" $(PYTEST_ARGS)

# The decoders' mutation fuzzers, long: 200000 damaged inputs per decoder
# (the fast suite runs a few thousand).  FUZZ_ITERATIONS=... for another count.
FUZZ_ITERATIONS ?= 200000
fuzz: $(STAMP)
	DRGATE_FUZZ_ITERATIONS=$(FUZZ_ITERATIONS) $(VENV)/bin/pytest -q tests/fuzz $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# On both cores: every test that needs neither the lab's namespaces
# (corosync), nor a two-site lab (e2e), nor Spark (two local[2] sessions on
# two cores took twice as long as one): the fast tests, the embedded bus's
# contract, broker sites on loopback and the rhea interop suite; then the rest
# one at a time (the e2e and corosync tests share the lab's namespaces and
# its lock).  Tests marked `long` (see README.md: the corosync
# variant of the two-site scenarios, a big resync, the lag and traffic jobs on
# a Spark cluster, a collected two-site audit) run with make test-long,
# outside CI's 45 minutes.
FAST_TESTS := not slow and not corosync and not e2e and not spark and not long
PARALLEL_TESTS := not e2e and not corosync and not spark and not long
pytest: $(STAMP) $(RHEA)
	$(VENV)/bin/pytest -q -n 2 -m "$(PARALLEL_TESTS)" $(PYTEST_ARGS)
	$(VENV)/bin/pytest -q --durations=30 -m "not ($(PARALLEL_TESTS)) and not long" $(PYTEST_ARGS)

test-long: $(STAMP)
	$(VENV)/bin/pytest -q -m long $(PYTEST_ARGS)

# Install the Debian packages only when something is missing, so that a
# developer without root can still run the fast suites.
deb:
	@missing=""; for p in $(DEB_PKGS); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "install ok installed" || missing="$$missing $$p"; \
	done; \
	command -v npm >/dev/null || missing="$$missing npm"; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  if [ "$$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends $$missing; \
	fi

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

# rhea from the npm registry, at the version package-lock.json pins.
$(RHEA): lab/rhea/package.json lab/rhea/package-lock.json
	cd lab/rhea && npm ci --no-audit --no-fund
	touch $(RHEA)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache lab/rhea/node_modules

# Resync of a 512 MiB primary (2 x 262,144 messages of 1 KiB) and a rules
# switch of a 200,000-message queue: rate and the egress's and ingress's peak
# RSS over their steady state (bench/resync_bench.py; about 15 minutes).
bench-resync: $(STAMP)
	$(PY) bench/resync_bench.py --switch 200000

# The broker journal: commit throughput (fsync batch vs never, fdatasync
# latency) and the restart time of a journal of 1,000,000 durable messages,
# with and without a checkpoint (bench/journal_bench.py; a few minutes).
bench-journal: $(STAMP)
	$(PY) bench/journal_bench.py

# Settled durable publishes/s on a 3-node site whose brokers keep journals
# (fsync: batch) against a memory-only site, 1 and 4 publishers with 100 in
# flight each; journals under DURABLE_DIR, which must be on a real disk
# (bench/broker_bench.py --durable; embedded bus, and corosync when root; a
# few minutes).
DURABLE_DIR ?= /var/tmp
bench-durable: $(STAMP)
	$(PY) bench/broker_bench.py --durable --dir $(DURABLE_DIR)

# drgate side by side with RabbitMQ's shovel over the same WAN emulator, in one
# run (bench/peer_rabbitmq.py; about 10 minutes).  It needs rabbitmq-server
# (Debian 12, with its shovel and AMQP 1.0 plugins), which no test needs, so
# neither this target nor `make deb` installs it.
bench-peer: $(STAMP)
	@dpkg-query -W -f='$${Status}' rabbitmq-server 2>/dev/null | grep -q "install ok installed" || \
	  { echo "bench-peer needs rabbitmq-server; install it with:"; \
	    echo "  sudo apt-get install -y --no-install-recommends rabbitmq-server"; exit 2; }
	$(PY) bench/peer_rabbitmq.py

# µs of CPU per delivered message of every process role, on sites of 3 and 1
# node(s), and a py-spy profile of the egress and the ingress when py-spy is on
# the PATH (bench/e2e_bench.py --cpu-only; docs/performance.md).
PROFILE_DIR ?= /tmp/drgate-profile
bench-cpu: $(STAMP)
	$(PY) bench/e2e_bench.py --cpu-only --profile $(PROFILE_DIR)

# The same burst of 2 KB messages at 25, 50 and 100 ms one way, in one run
# (bench/e2e_bench.py --wan-delays; docs/performance.md; about 8 minutes).
bench-wan: $(STAMP)
	$(PY) bench/e2e_bench.py --wan-delays 25,50,100

# This tree against BASE, bench/e2e_bench.py ARGS alternating between them for
# ROUNDS rounds, every table cell side by side (bench/ab.py; docs/performance.md).
BASE ?= HEAD
ROUNDS ?= 3
ARGS ?= --cpu-paced 500,1000 --step 6 --cpu-nodes 3
bench-ab: $(STAMP)
	$(PY) bench/ab.py $(BASE) --rounds $(ROUNDS) -- $(ARGS)

# One broker serving one consumer in one process: the delivery path's cost
# (bench/broker_deliver.py; docs/performance.md).
bench-deliver: $(STAMP)
	$(PY) bench/broker_deliver.py

# The drgate-capture data source against Parquet, rows/s on local[2] and on the
# lab's standalone cluster (a master and two 1-core workers from the pyspark
# jars, lab/spark.py), 10 million records in the same run
# (bench/analysis_bench.py; docs/analysis.md, "Performance"; several minutes).
ANALYSIS_RECORDS ?= 10000000
bench-analysis: $(STAMP)
	$(PY) bench/analysis_bench.py --records $(ANALYSIS_RECORDS)

# A randomized fault run (tests/chaos, docs/chaos.md): two durable sites,
# clients for the whole run, FAULTS overlapping faults drawn from SEED (a
# fresh one, printed, when empty), then the checker.  BUS=corosync needs
# root; the run holds the lab's lock (fixed netns names and ports).
SEED   ?=
FAULTS ?= 200
BUS    ?= embedded
chaos: $(STAMP)
	flock /tmp/drgate-corosync.lock $(PY) bench/chaos.py --faults $(FAULTS) --bus $(BUS) \
	  $(if $(SEED),--seed $(SEED)) $(if $(START_TIMEOUT),--start-timeout $(START_TIMEOUT)) \
	  $(if $(RATE_SCALE),--rate-scale $(RATE_SCALE))
