# Everything a fresh machine needs, in a virtual environment of the project's own.
# torch is pinned to the CPU build that installs offline here (constraints.txt keeps it there).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

BENCH_VENV ?= .venv-bench
BENCH_STAMP := $(BENCH_VENV)/.installed-stamp

.PHONY: install bench test lint typecheck bench-peers bench-dp bench-gpu clean docs

install: $(STAMP)

$(STAMP): setup.cfg setup.py constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[job,test]"
	touch $(STAMP)

# The main job: per-sample gradients on real digits and diabetes data, checked against the loop.
bench: $(STAMP)
	$(BIN)/python -m gradhooks bench $(ARGS)

# The test suite, on every core (pytest-xdist; the tests run one intra-op thread each, so one
# worker per core; TEST_JOBS=0 runs it in this process). The real-size tier keeps to one worker
# (tests/conftest.py groups it), so that two real-size models never share the memory at once.
TEST_JOBS ?= auto
# --durations=30: the slowest tests, printed at the end of every run (CI's log shows what to cut).

test: $(STAMP)
	$(BIN)/python -m pytest -n $(TEST_JOBS) --dist loadgroup --durations=30 $(ARGS)

# The linter (ruff.toml: pyflakes' rules and import order) over the library, the tests, the
# examples and the benchmarks; `make lint ARGS=--fix` sorts the imports.
lint: $(STAMP)
	$(BIN)/python -m ruff check gradhooks tests examples benchmarks $(ARGS)

# The type checker (mypy.ini): the public API's modules (gradhooks/__init__.py, hooks.py, api/,
# fisher.py, readers/attribution/__init__.py, tools/reference.py, tools/token_losses.py),
# fully annotated; the rest of the package followed silently. About 30 s of CPU from cold.
typecheck: $(STAMP)
	$(BIN)/python -m mypy $(ARGS)

# The torch users have (issue 40, point 7; docs/development.md, "Torch versions"). Each venv has
# its own constraints file: PIP_CONSTRAINT replaces the machine-wide pip cap for that venv only.
# test-newest: a fixed slice of the suite (every rule x every reader, the set-ups, the zoo's
# transformers rows) on the newest torch that installs here without a large download.
.PHONY: test-newest smoke-floor
NEWEST_VENV ?= .venv-newest
NEWEST_CONSTRAINTS ?= .ci/constraints-newest.txt
NEWEST_STAMP := $(NEWEST_VENV)/.installed-stamp
# The slice (about 4 minutes on 2 cores): every rule x every reader in float64 with the mean
# reduction, the set-ups (not their hypothesis sampler, 110 s alone), the zoo's transformers rows.
NEWEST_READERS_K ?= f64 and mean
NEWEST_ZOO_K ?= not timm and not tv- and not test_setups_match_loop

$(NEWEST_STAMP): setup.cfg setup.py $(NEWEST_CONSTRAINTS)
	$(PYTHON) -m venv $(NEWEST_VENV)
	PIP_CONSTRAINT=$(NEWEST_CONSTRAINTS) $(NEWEST_VENV)/bin/python -m pip install --quiet \
		-e ".[job,zoo]" pytest pytest-xdist hypothesis numpy opacus
	touch $(NEWEST_STAMP)

test-newest: $(NEWEST_STAMP)
	$(NEWEST_VENV)/bin/python -m pytest -n $(TEST_JOBS) -q -p no:cacheprovider \
		tests/test_torch_internals.py tests/test_every_rule_every_reader.py \
		-k "$(NEWEST_READERS_K)" $(ARGS)
	$(NEWEST_VENV)/bin/python -m pytest -n $(TEST_JOBS) -q -p no:cacheprovider tests/test_setup_*.py \
		tests/test_zoo.py -k "$(NEWEST_ZOO_K)" $(ARGS)

# smoke-floor: import gradhooks and run the main job on the tested floor (FLOOR_TORCH, the lower
# bound of install_requires; gradhooks/base/torch_internals.py names what older releases lack).
# Its CPU wheel lies on local disk here; FLOOR_PIP_ARGS may name another index (e.g.
# --index-url https://download.pytorch.org/whl/cpu) to try a lower one.
FLOOR_VENV ?= .venv-floor
FLOOR_TORCH ?= 2.13.0
FLOOR_PIP_ARGS ?=

smoke-floor:
	test -x $(FLOOR_VENV)/bin/python || $(PYTHON) -m venv $(FLOOR_VENV)
	echo "torch==$(FLOOR_TORCH)" > $(FLOOR_VENV)/constraints.txt
	PIP_CONSTRAINT=$(FLOOR_VENV)/constraints.txt $(FLOOR_VENV)/bin/python -m pip install --quiet \
		$(FLOOR_PIP_ARGS) "torch==$(FLOOR_TORCH)"
	PIP_CONSTRAINT=$(FLOOR_VENV)/constraints.txt $(FLOOR_VENV)/bin/python -m pip install --quiet \
		-e ".[job]"
	$(FLOOR_VENV)/bin/python -c "import torch, gradhooks; print('torch', torch.__version__, '| gradhooks', gradhooks.__version__)"
	$(FLOOR_VENV)/bin/python -m gradhooks bench $(ARGS)

# The documentation site, offline, into site/ (mkdocs-material + mkdocstrings; mkdocs.yml, docs/).
# Strict: a warning (a broken link or anchor, a page missing from the nav, an API object not
# found) fails the build. The docs extra joins the project's venv (torch stays pinned).
DOCS_STAMP := $(VENV)/.docs-stamp

$(DOCS_STAMP): setup.cfg setup.py constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[docs]"
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict --site-dir site $(ARGS)

$(BENCH_STAMP): setup.cfg setup.py constraints.txt
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -m pip install --quiet torch==2.13.0
	$(BENCH_VENV)/bin/python -m pip install --quiet -c constraints.txt -e ".[bench]"
	touch $(BENCH_STAMP)

# gradhooks against Opacus, BackPACK, ExpandedWeights, torch.func and the loop (benchmarks/README.md).
bench-peers: $(BENCH_STAMP)
	$(BENCH_VENV)/bin/python benchmarks/peers.py $(ARGS)

# DP clipping: gradhooks' book-keeping and two-pass against Opacus' ghost and hooks clipping
# (benchmarks/README.md, "DP clipping").
bench-dp: $(BENCH_STAMP)
	$(BENCH_VENV)/bin/python benchmarks/dp.py $(ARGS)

# The GPU run (issue 39): benchmarks/scale.py --gpu on the first CUDA device, writing
# benchmarks/results/gpu.md and gpu.json: GPT-2 small (B = 32, T = 512, bf16 autocast), ViT-B/16
# (B = 64), the Llama-3.2-1B width (B = 8, T = 1024), every method, against plain training,
# torch.func and Opacus. No venv: it runs with $(GPU_PYTHON), which must hold a CUDA build of
# torch with transformers, torchvision, tqdm and opacus (pip install opacus beside it).
GPU_PYTHON ?= python3
bench-gpu:
	$(GPU_PYTHON) benchmarks/scale.py --gpu $(ARGS)

clean:
	rm -rf $(VENV) $(BENCH_VENV) build *.egg-info .pytest_cache .hypothesis
