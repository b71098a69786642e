# `make test` and `make demo` do all set-up on a fresh machine: a virtual env in .venv with the
# dependencies (pyproject.toml installs no packages: the code runs from this folder, `python -m ...`),
# then the suite / the demo run.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Where torch and torchvision come from. Empty (default): PyPI, whose torch 2.14 wheels are CUDA 13
# builds with kernels for sm_75 ... sm_120, none for V100 (sm_70). For V100s, PyTorch's own index
# of CUDA 12.6 builds, which still ship sm_70 kernels, into a fresh venv (README, "GPUs"):
#   rm -rf .venv && make install TORCH_INDEX=https://download.pytorch.org/whl/cu126
TORCH_INDEX ?=

.PHONY: install test demo study study-full clean kernel-sweep slurm gpu-wheels gpu-smoke

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
ifneq ($(TORCH_INDEX),)
	$(PY) -m pip install torch torchvision --index-url $(TORCH_INDEX)
endif
	$(PY) -m pip install -e ".[test]" $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
	$(PY) -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'kernels for', *torch.cuda.get_arch_list())"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP) slurm
	$(PY) -m pytest -q -ra

FASHION_MNIST := /usr/share/datasets/fashion-mnist

# Fashion-MNIST shards -> MAE pretraining of the mini ViT on CPU -> kNN / linear probe vs random
# init (experiments/fashion_mnist/demo.py). Installs the Debian data package when it is missing and we are root.
demo: $(STAMP) $(FASHION_MNIST)
	$(PY) -m experiments.fashion_mnist.demo

# The quick study: every method on Fashion-MNIST with a third of an epoch, 2 seeds, kNN / linear probe /
# fine-tuning -> docs/RESULTS_quick.md + docs/figures/quick/ (experiments/fashion_mnist/study.py; about
# 90 min on 2 CPU cores). Reruns skip finished runs.
study: $(STAMP) $(FASHION_MNIST)
	$(PY) -m pip install -q -e ".[study]"
	$(PY) -m experiments.fashion_mnist.study

# The deciding study: 10 epochs per method (frozen features also at 1 and 3), fine-tuning on all 60k
# images, then energy and MixedAE's Table A4 ablations at 3 epochs; STUDY_JOBS runs side by side (cores / jobs
# threads each) -> docs/RESULTS.md, docs/figures/, docs/study/ (run summaries). About 8 hours per seed
# on 2 CPU cores (README): stop it any time (Ctrl-C) and run it again to resume.
STUDY_SEEDS ?= 0,1
STUDY_JOBS ?= 2
study-full: $(STAMP) $(FASHION_MNIST)
	$(PY) -m pip install -q -e ".[study]"
	$(PY) -m experiments.fashion_mnist.study --preset full --jobs $(STUDY_JOBS) --seeds $(STUDY_SEEDS)
	$(PY) -m experiments.fashion_mnist.study --preset ablation --jobs $(STUDY_JOBS) --seeds $(STUDY_SEEDS)
	$(PY) -m experiments.fashion_mnist.report --preset full

# Compile the fused Triton kernels for sm_80 and sm_90 at every shape x dtype x mode, no GPU needed
# (kernels/compile_check.py, about 15 min on 2 cores): shared memory, registers, spills ->
# docs/kernel_sweep.md and .json, the table in docs/KERNELS.md. `make test` compiles a subset.
kernel-sweep: $(STAMP)
	$(PY) -m kernels.compile_check --sweep full --json docs/kernel_sweep.json --markdown docs/kernel_sweep.md

# cp312 wheels of what the lent GPU machine lacks (Python 3.12, torch 2.11; no network there), at
# the versions this venv runs, into the git-ignored .whl/ (~5 MB) for the device tool's `carry`;
# there: pip install --no-index --no-deps --target /tmp/site .whl/*.whl; PYTHONPATH=/tmp/site:$PWD
GPU_WHEELS := deepspeed pydantic pydantic-core annotated-types typing-inspection webdataset braceexpand hjson
gpu-wheels: $(STAMP)
	rm -rf .whl && mkdir -p .whl/src
	$(PY) -m pip freeze | tr _ - | grep -iE '^($(subst $() ,|,$(filter-out deepspeed,$(GPU_WHEELS))))==' > .whl/src/pins.txt
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d .whl -r .whl/src/pins.txt
	$(PY) -m pip download -q --no-deps --no-binary=:all: -d .whl/src "deepspeed==$$($(PY) -c 'from importlib.metadata import version; print(version("deepspeed"))')"
	DS_BUILD_OPS=0 $(PY) -m pip wheel -q --no-deps --no-build-isolation -w .whl .whl/src/deepspeed-*.tar.gz
	rm -rf .whl/src && ls .whl

# Every phase of the GPU validation kit (tools/gpu_check.py) in its CPU smoke mode: debug model, a step
# or two, CUDA-only parts skipped with the reason; JSONs + log in runs/gpu_smoke (the suite runs the same).
gpu-smoke: $(STAMP)
	$(PY) -m tools.gpu_check tests bench methods loader study --smoke --out runs/gpu_smoke

$(FASHION_MNIST):
	@if [ "$$(id -u)" = 0 ]; then \
		apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist; \
	else \
		echo "Fashion-MNIST is missing: run 'sudo apt-get install dataset-fashion-mnist', then 'make demo' again"; \
		exit 1; \
	fi

# Debian's Slurm and munge for tests/launchers/test_real_slurm.py, which starts a one-node cluster on
# localhost. Installed only as root and only when missing; a failed install only makes those tests
# skip, saying why.
slurm:
	@if [ -x /usr/sbin/slurmctld ] && [ -x /usr/sbin/slurmd ] && [ -x /usr/sbin/munged ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing slurm-wlm and munge for the real-Slurm tests"; \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
			slurm-wlm munge >/dev/null) || echo "could not install slurm-wlm and munge: the real-Slurm tests will skip"; \
	else \
		echo "slurm-wlm and munge are missing (root installs them: make slurm): the real-Slurm tests will skip"; \
	fi

clean:
	rm -rf $(VENV) runs .pytest_cache
