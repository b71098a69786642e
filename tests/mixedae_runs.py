"""A MixedAE objective from the debug preset and a fake MixedAE run folder, for the tests of the
tools that read a run's checkpoints back (homologous_attention.py, segment_features.py)."""
import json
import shutil

import torch
from conftest import CPU_DS, REPO, fake_fashion_mnist, save_module_state

from data.write_shards import main as write_shards
from model.objectives import build_objective
from train.config.options import section
from train.config.parsing import parse_args, to_dict
from train.config.plan import build_encoder

PRESET = REPO / "train" / "configs" / "mixedae" / "debug.json"


def mixedae_objective(*options):
    """(objective in eval mode, config) from the debug preset with `options`, weights seeded 0."""
    cfg = parse_args(["--config", str(PRESET), "--ds_config", str(CPU_DS), *options])
    torch.manual_seed(0)
    return build_objective(cfg.objective, build_encoder(cfg), section(cfg)).eval(), cfg


def mixedae_run(tmp_path):
    """A mixedae run folder trained (in name) on a fake Fashion-MNIST written beside its test split:
    the encoder at init saved at step 1 (an epoch's end, pinned) and step 2, another encoder at
    step 3. Returns (run folder, the test split's index)."""
    shards = tmp_path / "shards"
    write_shards(["fashion-mnist", str(shards), "--src", str(fake_fashion_mnist(tmp_path / "idx", 20, 40)),
                  "--samples_per_shard", "20"])
    run = tmp_path / "run"
    obj, cfg = mixedae_objective("--model.in_chans", "3", "--data.source", "shards", "--data.train_index",
                                  str(shards / "train.json"))
    run.mkdir()
    (run / "config.json").write_text(json.dumps(to_dict(cfg)))
    shutil.copy(CPU_DS, run / "ds_config.json")
    for step in (1, 2, 3):
        tag = run / "checkpoints" / f"step{step:08d}"
        tag.mkdir(parents=True)
        if step == 3:  # another encoder: other attention logits, another selection
            with torch.no_grad():
                for p in obj.encoder.parameters():
                    p.add_(torch.randn_like(p))
        save_module_state(tag, obj.state_dict())
        (tag / "complete.json").write_text(json.dumps({"step": step, "zero_stage": 0, "pinned": step == 1}))
    return run, shards / "test.json"
