"""The summary record of cuda_syncs.py's runs: per objective and ZeRO stage, the syncs of a 30-step
run minus those of a 20-step run (10 steps, 2 of them log steps), beside the 20-step run's counts.
usage: python benchmarks/h100_20261124/cuda_syncs_summary.py RUNS_DIR OUT_JSON
(RUNS_DIR holds <objective>_z<stage>_<steps>.json from cuda_syncs.py)"""
import collections, glob, json, os, sys

runs, out = sys.argv[1], sys.argv[2]
rows = {}
for f in sorted(glob.glob(runs + "/*.json")):
    r = json.load(open(f)); rows[os.path.basename(f)[:-5]] = r
summary = {}
for key in sorted({k.rsplit("_", 1)[0] for k in rows}):
    a, b = rows.get(key + "_20"), rows.get(key + "_30")
    if not (a and b): continue
    diff = collections.Counter(b["counts"]); diff.subtract(a["counts"])
    summary[key] = {"per_10_steps_incl_2_log_steps": {k: v for k, v in diff.items() if v}, "run20": a["counts"]}
json.dump(summary, open(out, "w"), indent=1)
print(json.dumps(summary, indent=1)[:6000])
