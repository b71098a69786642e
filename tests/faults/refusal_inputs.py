"""The inputs, good and bad, that tests/faults/test_every_entry_point_refuses.py gives every
command: labeled RGB shards (and a held-out set of the same images), encoders of 1 and 3 channels,
a run folder of MAE, malformed JSON, a file where a folder is expected, weights that are not
weights, encoders whose description does not fit them, checkpoints that would run code."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch
from hostile_pickles import write_hostile_runs
from PIL import Image


def make_inputs(root: Path) -> Path:
    """Write every input under `root`, which the table's arguments name as {d}."""
    from safetensors.torch import save_file

    from data.write_shards import main as write_shards
    from model.registry import create_model

    for c in range(2):
        (root / "images" / f"class{c}").mkdir(parents=True)
        for i in range(3):
            Image.fromarray(np.full((28, 28, 3), 60 * c + 10 * i, dtype=np.uint8)).save(root / "images" / f"class{c}" / f"{i}.png")
    write_shards(["imagefolder", str(root / "images"), str(root / "shards"), "--workers", "1"])
    write_shards(["imagefolder", str(root / "images"), str(root / "held_out"), "--name", "test", "--workers", "1"])
    for name, chans, model in (("gray", 1, "vit_debug_patch4"), ("mini", 3, "vit_mini_patch4")):
        encoder = create_model(model, in_chans=chans)
        save_file({k: v.contiguous() for k, v in encoder.state_dict().items()}, str(root / f"{name}.safetensors"))
        (root / f"{name}.json").write_text(json.dumps({"timm_kwargs": encoder.timm_kwargs()}))
    (root / "malformed.json").write_text('{"optim": {"blr": 1e-3,}}\n')
    (root / "a_file").write_text("a file, not a folder")
    (root / "mae_run").mkdir()
    (root / "mae_run" / "config.json").write_text(json.dumps({"objective": "mae"}))
    (root / "empty").mkdir()
    (root / "current_tag").mkdir()  # a complete tag of the engine's own layout
    (root / "current_tag" / "model.safetensors").write_bytes(b"")
    (root / "current_tag" / "complete.json").write_text(json.dumps({"step": 1, "files": {"model.safetensors": 0}}))
    (root / "runs" / "entry" / "seed0").mkdir(parents=True)  # a study folder without finished runs
    write_bad_weights(root)
    write_misdescribed_encoders(root)
    write_hostile_runs(root)  # checkpoints that would create {d}/ran if read the unsafe way
    train = json.loads((root / "shards" / "train.json").read_text())  # indexes of these shards that do not fit them
    (root / "shards" / "swapped.json").write_text(json.dumps(train | {"classes": train["classes"][::-1]}))
    (root / "shards" / "climbing.json").write_text(json.dumps(train | {"shards": [{"file": "../a_file",
                                                                                 "samples": 1}]}))
    return root


def write_bad_weights(root: Path) -> None:
    """Weights that are not weights (tests/faults/test_weights_files.py tries every kind): random
    bytes, a torch file cut in half, a FIFO, and a run whose checkpoint's weights are cut short."""
    from safetensors.torch import save_file

    (root / "bad").mkdir()
    (root / "bad" / "random.safetensors").write_bytes(np.random.default_rng(0).bytes(4096))
    torch.save({"w": torch.zeros(64)}, root / "bad" / "whole.pth")
    whole = (root / "bad" / "whole.pth").read_bytes()
    (root / "bad" / "truncated.pth").write_bytes(whole[:len(whole) // 2])
    os.mkfifo(root / "bad" / "fifo.safetensors")
    tag = root / "bad_run" / "checkpoints" / "step00000001"
    tag.mkdir(parents=True)
    save_file({"encoder.w": torch.zeros(64)}, str(tag / "model.safetensors"))
    (tag / "model.safetensors").write_bytes((tag / "model.safetensors").read_bytes()[:-8])
    (tag / "complete.json").write_text(json.dumps({"step": 1, "world_size": 1}))  # a tag of before sizes and crc32s


def write_misdescribed_encoders(root: Path) -> None:
    """Small files that claim a large encoder: a .json beside an export describing 10**7 blocks or a
    depth in quotes, a block numbered 9999999 among two, a broadcast view standing for 1.3 GB."""
    from safetensors.torch import save_file

    from model.registry import create_model

    encoder = create_model("vit_debug_patch4")
    state = {k: v.contiguous() for k, v in encoder.state_dict().items()}
    for name, kwargs in (("deep", {"depth": 10**7}), ("quoted", {"depth": "2"})):
        save_file(state, str(root / f"{name}.safetensors"))
        (root / f"{name}.json").write_text(json.dumps({"timm_kwargs": encoder.timm_kwargs() | kwargs}))
    save_file(state | {"blocks.9999999.norm1.weight": torch.ones(32)}, str(root / "bad" / "gapped.safetensors"))
    torch.save({"model": {"w": torch.zeros(1, 32).expand(10**7, 32)}}, root / "bad" / "broadcast.pth")
