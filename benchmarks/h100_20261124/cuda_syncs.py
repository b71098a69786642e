"""Real CUDA host syncs of the training loop, counted with torch.cuda.set_sync_debug_mode('warn').
usage: python benchmarks/h100_20261124/cuda_syncs.py OBJECTIVE DS_CONFIG STEPS OUT_JSON  (steps of 5-step log windows)"""
import collections, json, os, sys, tempfile, traceback, warnings
import torch
sys.path.insert(0, os.getcwd())
from train.pretrain import main
ROOT = os.getcwd() + "/"
objective, ds, steps, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
extra = {"mae": [], "mixedae": ["--config", "train/configs/mixedae/debug.json"],
         "maeplus": ["--config", "train/configs/maeplus/debug.json"],
         "mlomae": ["--config", "train/configs/mlomae/debug.json"],
         "energy": ["--config", "train/configs/energy/debug.json"]}[objective]
counts = collections.Counter()
def hook(message, category, filename, lineno, file=None, line=None):
    if "synchroniz" not in str(message):
        return
    owner = "other"
    for fr in reversed(traceback.extract_stack()[:-1]):
        f = fr.filename
        if "/deepspeed/" in f:
            owner = "deepspeed " + f.split("/deepspeed/")[-1] + f":{fr.lineno} {fr.name}"; break
        if f.startswith(ROOT) and "/benchmarks/" not in f:
            owner = "ours " + f[len(ROOT):] + f":{fr.lineno} {fr.name}"; break
    counts[owner] += 1
warnings.showwarning = hook
warnings.simplefilter("always")
torch.cuda.set_sync_debug_mode("warn")
with tempfile.TemporaryDirectory() as d:
    main(["--ds_config", ds, "--config", "train/configs/mae/debug.json", *extra, "--output_dir", d,
          "--data.source", "synthetic", "--run.max_steps", str(steps), "--run.log_every", "5",
          "--run.ckpt_every", "1000", "--run.progress", "false", "--run.tensorboard", "false",
          "--run.export", "false", "--data.epoch_size", str(16 * 1000)])
json.dump({"objective": objective, "ds": ds, "steps": steps, "counts": dict(counts)}, open(out, "w"), indent=1)
print(objective, ds, steps, sum(counts.values()))
