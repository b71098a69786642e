#!/bin/bash
# Device run 2: the redesigned fused kernels on the H100: GPU parity tests, old-vs-new A/B, bench + e2e ratios.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
mkdir -p $OUT; L=$OUT/run2.log
{
echo "== gpu-marked kernel tests"
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels -ra 2>&1 | tail -25
echo "== old vs new A/B"
timeout 200 python3 benchmarks/h100_20261124/kernel_ab.py $OUT/kernel_ab_h100.json .gpu/old_restricted_triton.py 2>&1 | tail -20
echo "== kernels/bench.py bf16, train/bench_objectives.py mixedae adpe"
timeout 60 python3 -m kernels.bench --dtype bf16 --out_dir $OUT 2>&1 | tail -20
timeout 120 python3 -m train.bench_objectives --dtype bf16 --pairs mixedae adpe --out_dir $OUT 2>&1 | tail -10
} > $L 2>&1
tail -c 9000 $L
