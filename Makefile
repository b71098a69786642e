# `make test` and `make demo` do all set-up on a fresh machine, without root: a virtual env in .venv
# with the dependencies (pyproject.toml installs no packages: the code runs from this folder,
# `python -m ...`), then the suite / the demo run. Nothing is installed outside the venv.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Where torch and torchvision come from. Empty (default): PyPI, whose torch 2.14 wheels are CUDA 13
# builds with kernels for sm_75 ... sm_120, none for V100 (sm_70). For V100s, PyTorch's own index
# of CUDA 12.6 builds, which still ship sm_70 kernels, into a fresh venv (docs/GPU.md):
#   rm -rf .venv && make install TORCH_INDEX=https://download.pytorch.org/whl/cu126
TORCH_INDEX ?=

.PHONY: install test demo fashion-mnist study study-full clean kernel-sweep slurm gpu-wheels gpu-wheel-pins gpu-smoke

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

# The suite, on TEST_WORKERS pytest-xdist workers, each test file whole on one of them (so a module's
# fixture is built once), the longest files first (tests/conftest.py LONGEST_FILES). Most tests keep
# one core busy or wait on the processes they start, so two workers suit 2 cores (README: the time);
# TEST_WORKERS=0: one process. The real-Slurm tests
# (tests/launchers/test_real_slurm.py) need Debian's slurm-wlm and munge, which CI (.ci/run)
# installs; elsewhere they skip, saying why (optional: `make slurm`).
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# Fashion-MNIST shards -> MAE pretraining of the mini ViT on CPU -> kNN / linear probe vs random
# init (experiments/fashion_mnist/demo.py). The idx files come from Debian's dataset-fashion-mnist
# (/usr/share/datasets/fashion-mnist) when it is installed, else from runs/fashion-mnist, where they
# are downloaded from Zalando's published location and checked when missing (data/fashion_mnist.py).
demo: $(STAMP)
	$(PY) -m experiments.fashion_mnist.demo

# The Fashion-MNIST shards the demo and the studies share (runs/shards/fashion_mnist), written once
# from the idx files found or downloaded as for the demo.
fashion-mnist: $(STAMP)
	$(PY) -c "from experiments.fashion_mnist.common import fashion_mnist_shards; fashion_mnist_shards()"

# The quick study: every method on Fashion-MNIST with a third of an epoch, 2 seeds, kNN / linear probe /
# fine-tuning -> docs/RESULTS_quick.md + docs/figures/quick/ (experiments/fashion_mnist/study.py; about
# 90 min on 2 CPU cores). Reruns skip finished runs.
study: $(STAMP) fashion-mnist
	$(PY) -m pip install -q -e ".[study]"
	$(PY) -m experiments.fashion_mnist.study

# The deciding study: 10 epochs per method (frozen features also at 1 and 3), fine-tuning on all 60k
# images, then energy and MixedAE's Table A4 ablations at 3 epochs; STUDY_JOBS runs side by side (cores / jobs
# threads each) -> docs/RESULTS.md, docs/figures/, docs/study/ (run summaries). About 8 hours per seed
# on 2 CPU cores (docs/FASHION_MNIST.md): stop it any time (Ctrl-C) and run it again to resume.
STUDY_SEEDS ?= 0,1
STUDY_JOBS ?= 2
study-full: $(STAMP) fashion-mnist
	$(PY) -m pip install -q -e ".[study]"
	$(PY) -m experiments.fashion_mnist.study --preset full --jobs $(STUDY_JOBS) --seeds $(STUDY_SEEDS)
	$(PY) -m experiments.fashion_mnist.study --preset ablation --jobs $(STUDY_JOBS) --seeds $(STUDY_SEEDS)
	$(PY) -m experiments.fashion_mnist.report --preset full

# Compile the fused Triton kernels for sm_80 and sm_90 at every shape x dtype x mode, no GPU needed
# (kernels/compile_check.py): shared memory, registers, spills ->
# docs/kernel_sweep.md and .json, the table in docs/KERNELS.md. `make test` compiles a subset.
kernel-sweep: $(STAMP)
	$(PY) -m kernels.compile_check --sweep full --json docs/kernel_sweep.json --markdown docs/kernel_sweep.md

# cp312 wheels of what a GPU machine without network access lacks (Python 3.12, torch 2.11 there), at
# the versions this venv runs, into the git-ignored .whl/ (~8 MB), copied there with the code; there:
# pip install --no-index --no-deps --target SITE .whl/*.whl; PYTHONPATH=SITE:$PWD
# FLASH_ATTN_4=1 adds flash-attn-4 and the CUTLASS DSL it compiles with (~100 MB; docs/GPU.md).
GPU_WHEELS := deepspeed pydantic pydantic-core annotated-types typing-inspection webdataset braceexpand hjson torchao \
	$(if $(FLASH_ATTN_4),flash-attn-4 nvidia-cutlass-dsl nvidia-cutlass-dsl-libs-base nvidia-cutlass-dsl-libs-core \
	nvidia-cutlass-dsl-libs-cu12 apache-tvm-ffi torch-c-dlpack-ext quack-kernels)
gpu-wheels: $(STAMP)
	rm -rf .whl && mkdir -p .whl/src
	$(MAKE) -s gpu-wheel-pins > .whl/src/pins.txt
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d .whl -r .whl/src/pins.txt
	$(PY) -m pip download -q --no-deps --no-binary=:all: -d .whl/src "deepspeed==$$($(PY) -c 'from importlib.metadata import version; print(version("deepspeed"))')"
	DS_BUILD_OPS=0 $(PY) -m pip wheel -q --no-deps --no-build-isolation -w .whl .whl/src/deepspeed-*.tar.gz
	rm -rf .whl/src && ls .whl

# name==version of each of GPU_WHEELS but deepspeed (built from source above) as this venv has it;
# `pip list --format=freeze`, as `pip freeze` writes `name @ file://...` for a wheel installed from a file.
gpu-wheel-pins:
	@$(PY) -m pip list --format=freeze | tr _ - | grep -iE '^($(subst $() ,|,$(filter-out deepspeed,$(GPU_WHEELS))))=='

# Every phase of the GPU validation kit (tools/gpu_check.py) in its CPU smoke mode: debug model, a step
# or two, CUDA-only parts skipped with the reason; JSONs + log in runs/gpu_smoke (the suite runs the same).
gpu-smoke: $(STAMP)
	$(PY) -m tools.gpu_check compile tests bench methods loader study scale --smoke --out runs/gpu_smoke

# Optional, for developers (no target depends on it): Debian's Slurm and munge, with which `make test`
# also runs tests/launchers/test_real_slurm.py (a one-node cluster on localhost, run as root). As root
# (sudo make slurm); CI's .ci/run installs the same before `make test`.
slurm:
	@if [ "$$(id -u)" != 0 ]; then echo "make slurm installs Debian packages: run it as root (sudo make slurm)"; exit 1; fi
	apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurm-wlm munge

# Also removes runs/fashion-mnist, the downloaded idx files.
clean:
	rm -rf $(VENV) runs .pytest_cache
