# Two commands set everything up: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install bytecode browser demo test check layers bench chaos soak proto clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,dev]'
	touch $(STAMP)

install: $(STAMP)

# The project's bytecode (its own modules: pip wrote the dependencies' at install). Where PYTHONDONTWRITEBYTECODE
# is set, nothing else writes it, and each process would compile what it imports from source: 0.2 s of CPU at
# every worker's start, and `make test` starts some two hundred clusters. Only what changed is compiled again.
bytecode: $(STAMP)
	$(PY) -m compileall -q -j 0 rallypoint basics chaos client cluster etcd orchestrator proto recovery workers

demo: $(STAMP) bytecode
	$(PY) examples/demo_cluster.py
	$(VENV)/bin/rallypoint run examples/pipeline_mlp.py --fail kill:stage2@12

# The whole suite in two parts, one after the other, sharing one JAX compilation cache: the tests that start no
# process on UNIT_PROCS processes (pytest-xdist: they time nothing, and ~230 s on one is ~160 s on two here), then
# the tests that start processes, with their 25 slowest at the end (CI's log shows where the time goes). Both parts
# run whatever the first's outcome; the status is the first failure's. TEST_PROCS=2 runs the second part on two
# processes too (a module's tests stay together on one, in order): 17.5 min instead of 25 for the whole suite on
# this 2-core host (before the workers' zygote), but timing-sensitive tests still fail beside another test's
# cluster (a replacement worker's 2 s lease expiring on the loaded box), so CI runs it on one.
UNIT_PROCS ?= 2
TEST_PROCS ?= 1
test: $(STAMP) bytecode layers browser
	@cache=$$(mktemp -d -t rallypoint-tests-jax-cache-XXXXXX) && trap 'rm -rf "$$cache"' EXIT && rc=0; \
	export RALLYPOINT_TESTS_JAX_CACHE="$$cache"; \
	echo "make test: the tests that start no process, on $(UNIT_PROCS)"; \
	$(PY) -m pytest -q -m "not processes" $(if $(filter-out 1,$(UNIT_PROCS)),-n $(UNIT_PROCS)) tests || rc=$$?; \
	echo "make test: the tests that start processes, on $(TEST_PROCS)"; \
	$(PY) -m pytest -q --durations=25 -m processes \
	  $(if $(filter-out 1,$(TEST_PROCS)),-n $(TEST_PROCS) --dist loadfile) tests || { s=$$?; [ $$rc != 0 ] || rc=$$s; }; \
	exit $$rc

# The fast tier for the edit-test loop: the unit and property tests that start no process
# (tests marked `processes` left out; tests/conftest.py marks them and refuses a process to the rest).
check: $(STAMP)
	$(PY) -m pytest -q -m "not processes" tests

# Chromium for the dashboard's browser tests (tests/integration/test_dashboard.py), from the system
# packages when it is missing and this is root with apt-get; otherwise those tests skip and say why.
browser:
	@if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	    command -v google-chrome >/dev/null 2>&1; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "make browser: installing chromium (apt-get)"; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -qq chromium >/dev/null 2>&1 || \
	  { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq chromium >/dev/null 2>&1; } || \
	  echo "make browser: could not install chromium; the dashboard's browser tests will skip"; \
	else echo "make browser: no chromium and no root apt-get; the dashboard's browser tests will skip"; fi

# The import-linter contracts of .importlinter, checked against the package as a wheel
# installs it (grimp needs one folder holding all of `rallypoint`; the repository maps
# the layer folders onto it, see pyproject.toml).
layers: $(STAMP)
	@tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp" "$(CURDIR)/build"' EXIT; rm -rf build && \
	$(PY) -m pip install --quiet --no-deps --target "$$tmp/site" . >/dev/null && \
	cd "$$tmp" && PYTHONPATH="$$tmp/site" $(CURDIR)/$(VENV)/bin/lint-imports --no-logo --no-cache $(CURDIR)/.importlinter

bench: $(STAMP) bytecode
	$(PY) bench/startup.py
	$(PY) bench/liveness.py
	$(PY) bench/dispatch.py
	$(PY) bench/device.py
	$(PY) bench/lm.py
	$(PY) bench/sharded.py
	$(PY) bench/final_cut.py
	$(PY) bench/commit_verify.py
	$(PY) bench/recovery.py
	$(PY) bench/leader.py
	$(PY) bench/leader_scale.py
	$(PY) bench/elastic.py
	$(PY) bench/mttr.py
	$(PY) bench/multihost.py
	$(PY) bench/lifecycle.py
	$(PY) bench/donation.py
	$(PY) bench/verify.py

# Every scenario once (the campaign scenarios are for `make soak`: they vary by seed).
chaos: $(STAMP)
	@fail=0; for s in scenarios/*.toml; do case $$s in */campaign*) continue;; esac; echo "== $$s"; \
	$(VENV)/bin/rallypoint chaos run $$s || fail=1; done; exit $$fail

# A soak campaign: the campaign scenario over 20 seeds, each a full run with every invariant; then the storm (ten
# minutes of faults every 5 s on a supervised cluster: killed processes come back as new incarnations) over 10 seeds,
# and the storm once on the pipeline with a stateless evaluator slice (about two hours in all).
soak: $(STAMP)
	$(VENV)/bin/rallypoint chaos campaign scenarios/campaign.toml --seeds 20
	$(VENV)/bin/rallypoint chaos campaign scenarios/campaign-storm.toml --seeds 10
	$(VENV)/bin/rallypoint chaos run scenarios/campaign-storm-eval.toml

proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. proto/rallypoint.proto
	sed -i 's/^from proto import/from rallypoint.proto import/' proto/rallypoint_pb2_grpc.py

clean:
	rm -rf $(VENV) .rallypoint build *.egg-info
