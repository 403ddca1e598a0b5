# The README's two set-up commands are `make start` and `make test`; both go
# through `make install`, which is idempotent.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
SHIM_STAMP := $(VENV)/.shim-built
NATIVE_STAMP := $(VENV)/.native-built
# Every direct and transitive dependency, for Linux and macOS, at an exact version
# with the hashes of its files; `make lock` refreshes it.
LOCK   := requirements.lock
UV_VERSION := 0.13.9

.PHONY: install lock start test check test-slow test-real test-kernels test-reliability doctor clean real-model browser

install: $(STAMP) $(SHIM_STAMP) $(NATIVE_STAMP) real-model

# On an old venv this syncs: what left the lock is uninstalled (scripts/sync_venv.py).
$(STAMP): pyproject.toml $(LOCK)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --require-hashes -r $(LOCK)
	$(BIN)/python scripts/sync_venv.py $(LOCK)
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP)

# On Linux, done only once the shim is built: without a C compiler the next
# `make install` tries again (macOS needs no shim).
$(SHIM_STAMP): $(STAMP) engine/native/cblas_shim.c scripts/build_blas_shim.sh
	sh scripts/build_blas_shim.sh $(BIN)/python
	if [ "$$(uname -s)" != Linux ] || [ -f $(VENV)/lib/mtplxd/libmtplxd_cblas.so ]; then touch $@; fi

# The CPU decode kernel for quantized weights (engine/quantized_rows.py), an MLX
# extension; on Linux, done only once it is built (macOS needs none).
$(NATIVE_STAMP): $(STAMP) engine/native/quantized_rows.cpp engine/native/CMakeLists.txt scripts/build_native.sh
	sh scripts/build_native.sh $(BIN)/python
	if [ "$$(uname -s)" != Linux ] || ls $(VENV)/lib/mtplxd/_mtplxd_quantized_rows*.so >/dev/null 2>&1; then touch $@; fi

# Resolves pyproject.toml (with the test extras) for every platform at once, keeping
# the versions already pinned where they still fit; LOCK_FLAGS=--upgrade takes the
# newest of everything. Run `make test` after it: the lock holds what the suite passed with.
lock:
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet uv==$(UV_VERSION)
	$(BIN)/uv pip compile pyproject.toml scripts/installer-tools.in --extra test --universal \
	    --python-version 3.11 --generate-hashes --quiet $(LOCK_FLAGS) -o $(LOCK)

# The real default model, SmolLM2-135M-Instruct from its GGUF file, with the MTP heads
# mtplxd ships for it, imported into the models folder (scripts/real_model.sh); offline,
# a message, and the embedded toy model stays the default.
real-model: $(STAMP) $(SHIM_STAMP) $(NATIVE_STAMP)
	sh scripts/real_model.sh $(BIN)

# Chromium for the page's browser tests (tests/test_page.py, Playwright drives it; no
# browser is downloaded): Debian's package, installed once with apt-get (as root, or
# through sudo); macOS and others: install Chromium at /usr/bin/chromium yourself.
CHROMIUM := /usr/bin/chromium
browser:
	@if [ -x $(CHROMIUM) ]; then echo "Chromium is installed ($(CHROMIUM))"; \
	elif command -v apt-get >/dev/null 2>&1; then \
	    SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	    $$SUDO apt-get install -y chromium || { $$SUDO apt-get update && $$SUDO apt-get install -y chromium; }; \
	else echo "no apt-get here: install Chromium at $(CHROMIUM) for tests/test_page.py" >&2; fi

start: install
	$(BIN)/mtplxd start

test: install
	$(BIN)/python -m pytest -q

# Types of the daemon, the adapters and the engine (pyproject.toml [tool.mypy]); CI runs it.
check: install
	$(BIN)/mypy

test-slow: install
	$(BIN)/python -m pytest -q -m slow

# The tests on the real model (SmolLM2-135M-Instruct, `make real-model`): import equality,
# tokenizer, answers; CI runs them after `make test`.
test-real: install
	$(BIN)/python -m pytest -q -m real_model

# The reliability suite at full size (docs/reliability.md): a 90-second soak, or SOAK
# seconds (`make test-reliability SOAK=600`: ten minutes, its memory curve must settle).
SOAK ?= 90
test-reliability: install
	$(BIN)/python -m pytest -q -s tests/reliability --soak-seconds $(SOAK)

# The engine tests under every BLAS kernel choice (scripts/kernel_matrix.py): the shim's
# AVX-512 / AVX2 / no few-row kernel, OpenBLAS on 1 and 2 threads, OPENBLAS_CORETYPE
# unset, Haswell and Sandybridge. About ten minutes on 2 cores.
test-kernels: install
	$(BIN)/python scripts/kernel_matrix.py

doctor: install
	$(BIN)/mtplxd doctor

clean:
	rm -rf $(VENV) build *.egg-info
