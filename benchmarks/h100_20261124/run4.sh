#!/bin/bash
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
mkdir -p $OUT/syncs
for obj in mae mixedae; do for z in 1 2; do for n in 20 30; do
  timeout 120 python3 benchmarks/h100_20261124/cuda_syncs.py $obj benchmarks/h100_20261124/small_bf16_zero$z.json $n $OUT/syncs/${obj}_z${z}_${n}.json 2>&1 | tail -2
done; done; done
python3 - <<'PY'
import json, glob, os, collections
out = os.environ["OUT"]; rows = {}
for f in sorted(glob.glob(out + "/syncs/*.json")):
    r = json.load(open(f)); rows[os.path.basename(f)[:-5]] = r
summary = {}
for key in sorted({k.rsplit("_", 1)[0] for k in rows}):
    a, b = rows.get(key + "_20"), rows.get(key + "_30")
    if not (a and b): continue
    diff = collections.Counter(b["counts"]); diff.subtract(a["counts"])
    summary[key] = {"per_10_steps_incl_2_log_steps": {k: v for k, v in diff.items() if v}, "run20": a["counts"]}
json.dump(summary, open(out + "/cuda_syncs_summary.json", "w"), indent=1)
print(json.dumps(summary, indent=1)[:6000])
PY
