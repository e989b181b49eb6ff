# The two commands the README gives: `make serve` and `make test`. Both create .venv on first use.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
# torch is pinned here, not in pyproject.toml, so that the package works with any recent torch
# while the set-up installs the build this project is tested with.
TORCH_VERSION ?= 2.13.0

.PHONY: install serve test lint typecheck unit docs clean container-smoke mutate

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==$(TORCH_VERSION)
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

install: $(BIN)/.installed

serve: install
	$(BIN)/batchserve serve

lint: install
	$(BIN)/ruff check service tests loadtests scripts deploy
	$(BIN)/lint-imports
	$(BIN)/ruff format --check service tests loadtests scripts deploy
	$(BIN)/hadolint Dockerfile

typecheck: install
	$(BIN)/mypy service loadtests

# Two workers (pytest-xdist), a test file each at a time so its module fixtures are built once:
# most tests wait on a server process more than they use a core.
unit: install
	$(BIN)/pytest -n 2 --dist loadfile

test: lint typecheck unit

# The documentation site (mkdocs.yml) into site/; --strict fails on any warning: a missing page,
# a broken link or anchor, a docstring mkdocstrings cannot render.
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# Mutation score of the batcher and the input parsing against their fast unit tests; not part
# of `make test`. All mutants (about 520) take about 17 minutes on 2 cores; `make mutate
# MUTATE_SAMPLE=80` scores 80 drawn at random from each module, about 4 minutes.
MUTATE_SAMPLE ?=
MUTATE_OPTIONS := --fail-under 90 $(if $(MUTATE_SAMPLE),--sample $(MUTATE_SAMPLE) --seed 1)
BATCHER_TESTS := tests/test_batch_clock.py tests/test_batch_selection.py tests/test_batch_refill.py \
	tests/test_batch_guards.py tests/test_estimates.py tests/test_batch_spans.py \
	tests/test_batch_intake.py tests/test_batching.py
mutate: install
	for piece in collector admission queue policy adaptive selection clock estimates run spans; do \
		$(BIN)/python scripts/mutate.py --module service/engine/batcher/$$piece.py \
			--tests $(BATCHER_TESTS) $(MUTATE_OPTIONS) || exit 1; \
	done
	for module in inputs tensor_layout bodies; do \
		$(BIN)/python scripts/mutate.py --module service/frontend/$$module.py --tests tests/test_inputs.py $(MUTATE_OPTIONS) || exit 1; \
	done

# Builds ./Dockerfile with buildah and runs the image (deploy/container_smoke.sh says how);
# needs root and `apt-get install buildah debootstrap`.
container-smoke: install
	TORCH_SPEC=torch==$(TORCH_VERSION) PYTHON=$(BIN)/python bash deploy/container_smoke.sh

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache site
