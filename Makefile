# Two commands set everything up: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install demo test layers bench chaos soak proto clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo_cluster.py
	$(VENV)/bin/rallypoint run examples/pipeline_mlp.py --fail kill:stage2@12

test: $(STAMP) layers
	$(PY) -m pytest -q tests

# The import-linter contracts of .importlinter, checked against the package as a wheel
# installs it (grimp needs one folder holding all of `rallypoint`; the repository maps
# the layer folders onto it, see pyproject.toml).
layers: $(STAMP)
	@tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp" build' EXIT && \
	$(PY) -m pip install --quiet --no-deps --target "$$tmp/site" . >/dev/null && \
	cd "$$tmp" && PYTHONPATH="$$tmp/site" $(CURDIR)/$(VENV)/bin/lint-imports --no-logo --no-cache $(CURDIR)/.importlinter

bench: $(STAMP)
	$(PY) bench/liveness.py
	$(PY) bench/dispatch.py
	$(PY) bench/recovery.py
	$(PY) bench/leader.py
	$(PY) bench/elastic.py
	$(PY) bench/mttr.py

# Every scenario once (the campaign scenarios are for `make soak`: they vary by seed).
chaos: $(STAMP)
	@fail=0; for s in scenarios/*.toml; do case $$s in */campaign*) continue;; esac; echo "== $$s"; \
	$(VENV)/bin/rallypoint chaos run $$s || fail=1; done; exit $$fail

# A soak campaign: the campaign scenario over 20 seeds, each a full run with every invariant.
soak: $(STAMP)
	$(VENV)/bin/rallypoint chaos campaign scenarios/campaign.toml --seeds 20

proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. proto/rallypoint.proto
	sed -i 's/^from proto import/from rallypoint.proto import/' proto/rallypoint_pb2_grpc.py

clean:
	rm -rf $(VENV) .rallypoint build *.egg-info
