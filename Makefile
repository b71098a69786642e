# `make test` and `make demo` do all set-up on a fresh machine: a virtual env in .venv with the
# package (editable) and its dependencies, then the suite / the demo run.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test demo clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -ra

# Short CPU pretraining of the mini ViT with MAE on the synthetic source, then export.
demo: $(STAMP)
	$(PY) train/pretrain.py --ds_config ds_configs/cpu_debug.json --config train/configs/demo_mae.json \
		--output_dir runs/demo_mae --resume auto

clean:
	rm -rf $(VENV) runs .pytest_cache
