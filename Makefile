# `make test` and `make demo` do all set-up on a fresh machine: a virtual env in .venv with the
# package (editable) and its dependencies, then the suite / the demo run.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test demo study clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -ra

FASHION_MNIST := /usr/share/datasets/fashion-mnist

# Fashion-MNIST shards -> MAE pretraining of the mini ViT on CPU -> kNN / linear probe vs random
# init (train/demo.py). Installs the Debian data package when it is missing and we are root.
demo: $(STAMP) $(FASHION_MNIST)
	$(PY) train/demo.py

# Every method on Fashion-MNIST with the same budget, 2 seeds, kNN / linear probe / fine-tuning
# -> docs/RESULTS.md + docs/figures/ (train/study.py; about 90 min on 2 CPU cores). Reruns skip finished runs.
study: $(STAMP) $(FASHION_MNIST)
	$(PY) -m pip install -q -e ".[study]"
	$(PY) train/study.py

$(FASHION_MNIST):
	@if [ "$$(id -u)" = 0 ]; then \
		apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist; \
	else \
		echo "Fashion-MNIST is missing: run 'sudo apt-get install dataset-fashion-mnist', then 'make demo' again"; \
		exit 1; \
	fi

clean:
	rm -rf $(VENV) runs .pytest_cache
