# The README's two set-up commands are `make start` and `make test`; both go
# through `make install`, which is idempotent.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install start test test-slow doctor clean

install: $(STAMP)

$(STAMP): pyproject.toml engine/native/cblas_shim.c scripts/build_blas_shim.sh
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	sh scripts/build_blas_shim.sh $(BIN)/python
	touch $(STAMP)

start: install
	$(BIN)/mtplxd start

test: install
	$(BIN)/python -m pytest -q

test-slow: install
	$(BIN)/python -m pytest -q -m slow

doctor: install
	$(BIN)/mtplxd doctor

clean:
	rm -rf $(VENV) build *.egg-info
