# rove's task file. Every target sets up the virtual environment it needs first.
#   make demo   - install and run the main job on the embedded default
#   make test   - install test tools, lint, and run the whole test suite (what CI runs)
#   make lint   - ruff (check + format), mypy (strict on every module, and on the benchmarks,
#                 which CI does not run), import-linter (layers)
#   make bench  - run the benchmarks; each prints one JSON line

PYTHON ?= python3
VENV ?= .venv
S3VENV ?= .venv-s3
BIN := $(VENV)/bin
# torch first, pinned: 2.13.0 is the CPU build that lies on this machine's disk;
# any other spec downloads several GB of CUDA packages.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?= --durations=25

.PHONY: demo demo-control-plane test test-chaos test-nemesis test-fast lint format bench typecheck-view clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet --disable-pip-version-check $(TORCH_SPEC)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[torch]'
	touch $@

# (the S3 server's environment installs beside the test tools: two pips at once, about
# 25 s less of CI on two cores; the recipe fails if either fails)
$(VENV)/.installed-tests: $(VENV)/.installed
	$(MAKE) --no-print-directory $(S3VENV)/.installed & s3=$$!; \
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[torch,tests]'; rc=$$?; \
	wait $$s3 && exit $$rc
	touch $@

# The S3 server the object-store checkpoint tests run against (moto's, tests/s3server.py),
# in an environment of its own: botocore pins python-dateutil<3, the kubernetes client >=3.
$(S3VENV)/.installed:
	$(PYTHON) -m venv $(S3VENV)
	$(S3VENV)/bin/pip install --quiet --disable-pip-version-check 'moto[server]>=5,<6'
	touch $@

DEMO_DIR ?= .rove-demo
DEMO_STEPS ?= 300
DEMO_FAULT ?= kill:1@150

# The main job: a small transformer trained by 2 workers under `rove run --standalone`
# (its own NATS server and master), a flash checkpoint every 5 steps; at step 150 rove
# kills rank 1 (--inject-fault) and the job heals itself from memory.
demo: $(VENV)/.installed
	rm -rf $(DEMO_DIR)
	ROVE_HOME=$(DEMO_DIR)/home $(BIN)/rove run --standalone --job demo --nproc-per-node 2 \
		--max-restarts 3 --inject-fault $(DEMO_FAULT) examples/train.py --steps $(DEMO_STEPS) \
		--ckpt-every 5 --step-sleep 0.03
	@echo "the ended job stays readable: ROVE_HOME=$(DEMO_DIR)/home $(BIN)/rove goodput --job demo"

# The control plane alone: two masters, simulated agents, a master killed with SIGKILL.
demo-control-plane: $(VENV)/.installed
	$(BIN)/python examples/control_plane_demo.py

# The quick tests run four at a time (pytest-xdist; they mostly wait on servers and
# subprocesses: two at a time kept 0.75 of the two cores busy, 153 s against 107 s),
# then the slow multi-process ones three at a time (two at a time kept 1.45 of the two
# cores busy: 1,213 CPU-seconds in 1,639 test-seconds, 847 s; many wait on timeouts and
# paced steps), then those that restart NATS servers on their ports
# (marked `restarts_nats`: beside other slow tests they made them fail) in two lanes of
# their own (`xdist_group`: they use about 0.6 of a core together), and beside them those
# that judge speed or time a recovery (marked `alone`: stragglers, hangs, the network
# check) one at a time: the two sessions took 237 s together against 134 + 196 s in turn
# (each session's ports apart: ROVE_TEST_PORTS, tests/support.free_port); the restarts'
# output is said after the alone tests'.
# Bytecode is cached while the tests run (PYTHONDONTWRITEBYTECODE emptied where the
# environment sets it): every test starts rove processes, and each compiled rove's
# modules and the tests' rewritten asserts afresh (the quick tests took 7% longer).
# Lint runs beside the quick tests, its output said after them (a fresh clone's lint takes
# 50-66 s of one core; beside it the quick tests took 141 s against 132 s alone); either
# failing fails the target.
test: export PYTHONDONTWRITEBYTECODE :=
test: $(VENV)/.installed-tests typecheck-view
	@$(MAKE) --no-print-directory lint > $(VENV)/lint.log 2>&1 & lint=$$!; \
	$(BIN)/python -m pytest -m "not slow" -n 4 $(PYTEST_ARGS); quick=$$?; \
	wait $$lint; linted=$$?; cat $(VENV)/lint.log; \
	if [ $$linted -ne 0 ]; then echo "make test: lint failed (its output is above)"; fi; \
	[ $$quick -eq 0 ] && [ $$linted -eq 0 ]
	$(BIN)/python -m pytest -m "slow and not alone and not restarts_nats" -n 3 --dist worksteal $(PYTEST_ARGS)
	@ROVE_TEST_PORTS=1/2 $(BIN)/python -m pytest -m restarts_nats -n 2 --dist loadgroup \
		$(PYTEST_ARGS) > $(VENV)/restarts_nats.log 2>&1 & nats=$$!; \
	ROVE_TEST_PORTS=2/2 $(BIN)/python -m pytest -m alone $(PYTEST_ARGS); alone=$$?; \
	wait $$nats; restarted=$$?; echo "--- the tests that restart NATS (ran beside):"; \
	cat $(VENV)/restarts_nats.log; [ $$alone -eq 0 ] && [ $$restarted -eq 0 ]

# The nemesis (tests/nemesis: NATS servers killed and cut off, a paused master, a full
# disk, a corrupted checkpoint, poison and floods) with more seeds than the suite's one
# (ROVE_NEMESIS_RUNS, default 5), the 75 s outage that the suite leaves out, then its
# table of what rove survived.
test-nemesis: $(VENV)/.installed-tests
	ROVE_NEMESIS_RUNS=$${ROVE_NEMESIS_RUNS:-5} $(BIN)/python -m pytest -m nemesis $(PYTEST_ARGS)
	$(BIN)/python -m tests.nemesis --scenario outage
	$(BIN)/python -m tests.nemesis --report

# The chaos tests with more seeds than the suite's one (ROVE_CHAOS_RUNS, default 10).
test-chaos: $(VENV)/.installed-tests
	ROVE_CHAOS_RUNS=$${ROVE_CHAOS_RUNS:-10} $(BIN)/python -m pytest tests/test_data_chaos.py \
		tests/test_stream_chaos.py -k "kills" $(PYTEST_ARGS)

test-fast: $(VENV)/.installed-tests
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

typecheck-view:
	@mkdir -p .typecheck/rove
	@for p in control agent shard_service checkpoint; do ln -sfn ../../$$p .typecheck/rove/$$p; done

lint: $(VENV)/.installed-tests typecheck-view
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/mypy
	MYPYPATH=benchmarks $(BIN)/mypy --explicit-package-bases benchmarks/*.py
	PYTHONPATH=.typecheck $(BIN)/lint-imports

format: $(VENV)/.installed-tests
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: $(VENV)/.installed-tests
	$(BIN)/python benchmarks/master_recovery.py --events 100000
	$(BIN)/python benchmarks/bus_throughput.py
	$(BIN)/python benchmarks/recovery.py
	$(BIN)/python benchmarks/checkpoint.py --size-mb 1024
	$(BIN)/python benchmarks/shards.py
	$(BIN)/python benchmarks/relaunch.py
	$(BIN)/python benchmarks/streaming.py
	$(BIN)/python benchmarks/tf_recovery.py

clean:
	rm -rf $(VENV) $(S3VENV) .typecheck .pytest_cache .mypy_cache .ruff_cache build dist *.egg-info
