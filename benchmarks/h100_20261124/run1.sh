#!/bin/bash
# Device run 1: environment, GPU-marked tests outside kernels, engine throughput + memory, syncs.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
mkdir -p $OUT; L=$OUT/run1.log
{
nvidia-smi -L; python3 -c "import torch, triton, timm, deepspeed; print(torch.__version__, torch.version.cuda, torch.cuda.get_arch_list(), torch.cuda.get_device_capability(), torch.cuda.is_bf16_supported(including_emulation=False), triton.__version__, timm.__version__, deepspeed.__version__)"
echo "== gpu-marked tests (train, model)"
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/train tests/model -x -ra 2>&1 | tail -25
echo "== host syncs test + device checks + memory on the GPU machine"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/train/test_host_syncs.py tests/train/test_memory.py tests/train/test_device_checks.py -ra 2>&1 | tail -15
} > $L 2>&1
for cfg in h100x1_bf16_zero1_b128 h100x1_fp16_zero2_b128; do
  echo "== dry run $cfg" >> $L
  timeout 60 python3 train/pretrain.py --ds_config benchmarks/h100_20261124/$cfg.json --data.source synthetic --dry-run --world_size 1 --gpu h100 >> $L 2>&1 | true
  echo "== bench $cfg" >> $L
  timeout 150 python3 train/bench.py --ds_config benchmarks/h100_20261124/$cfg.json --data.source synthetic --steps 10 --warmup 3 --out_dir $OUT >> $L 2>&1
done
tail -c 6000 $L
