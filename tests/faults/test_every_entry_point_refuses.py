"""Every command refuses bad input the way pretraining does (data/cli.py, train/run/cli.py): exit status
2, one line on stderr naming the problem and the fix, no traceback, nothing written.

The table runs each entry point against each class of bad input that applies to it: a path that
does not exist, a malformed or missing preset or index (file, line and column; the presets folder
and the nearest names), weights that do not fit the model (input channels, sizes, objective: both
values named), an output place that cannot be written, a misspelt option or a bad value. Each
call runs in this process through the wrapper the module's `__main__` block uses (checked below),
and two run as real scripts."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch
from conftest import REPO
from hostile_pickles import write_hostile_runs
from PIL import Image

from train.run.cli import cli

DEBUG = "train/configs/mae/debug.json"
CPU_DS = "ds_configs/cpu_debug.json"
A100 = "ds_configs/vit_b_8xa100_bf16_zero1.json"


def exits(main: Callable[[], int]) -> None:  # `sys.exit(main())`
    sys.exit(main())


def called(main: Callable[[], object]) -> None:  # `main()`
    main()


# module -> (its main, the wrapper its __main__ block runs it with, how that block reads)
ENTRY_POINTS = {
    "train.pretrain": ("train.run.command", cli, "run_script(main)"),
    "train.finetune": ("train.finetune", cli, "run_script(main)"),
    "train.linprobe": ("train.linprobe", cli, "run_script(main)"),
    "train.evaluate": ("train.evaluate", cli, "cli(main)"),
    "train.export": ("train.export", cli, "cli(main)"),
    "train.bench": ("train.bench", cli, "cli(main)"),
    "train.bench_objectives": ("train.bench_objectives", called, "main()"),
    "kernels.bench": ("kernels.bench", called, "main()"),
    "tools.census": ("tools.census", cli, "cli(main)"),
    "tools.scaling": ("tools.scaling", cli, "cli(lambda: sys.exit(main()))"),
    "train.convert_checkpoint": ("train.convert_checkpoint", cli, "cli(main)"),
    "data.write_shards": ("data.write_shards", called, "main()"),
    "data.index_shards": ("data.index_shards", exits, "sys.exit(main())"),
    "data.verify": ("data.verify", exits, "sys.exit(main())"),
    "launchers.submit": ("launchers.submit", exits, "sys.exit(main())"),
    "experiments.fashion_mnist.study": ("experiments.fashion_mnist.study", called, "main()"),
    "experiments.fashion_mnist.report": ("experiments.fashion_mnist.report", called, "main()"),
    "experiments.fashion_mnist.demo": ("experiments.fashion_mnist.demo", called, "main()"),
}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """Inputs good and bad, made once: labeled RGB shards (and a held-out set of the same images),
    encoders of 1 and 3 channels, a run folder of MAE, malformed JSON, a file where a folder is
    expected."""
    from safetensors.torch import save_file

    from data.write_shards import main as write_shards
    from model.registry import create_model

    root = tmp_path_factory.mktemp("inputs")
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


def no_pyplot(monkeypatch):
    """matplotlib missing (the report's figures cannot be drawn)."""
    from experiments.fashion_mnist import plots

    monkeypatch.setattr(plots, "pyplot", lambda: None)


# (entry point, class of bad input, argv ({d}: the inputs folder), what the one line must say, setup)
CASES = [
    ("train.pretrain", "malformed preset", ["--ds_config", CPU_DS, "--config", "{d}/malformed.json"],
     r"malformed.json:1:24 is not valid JSON .*line 1, column 24", None),
    ("train.pretrain", "missing preset", ["--ds_config", CPU_DS, "--config", "train/configs/mae/debugg.json"],
     r"presets live in train/configs/<method>/.*nearest: train/configs/mae/debug.json", None),
    ("train.pretrain", "missing ds_config", ["--ds_config", "ds_configs/cpu_debg.json", "--config", DEBUG],
     r"ds_config 'ds_configs/cpu_debg.json' does not exist", None),
    ("train.pretrain", "missing index", ["--ds_config", CPU_DS, "--config", DEBUG, "--data.source", "shards",
                                         "--data.train_index", "{d}/nowhere.json", "--output_dir", "{d}/out"],
     r"shard index .*nowhere.json not found", None),
    ("train.pretrain", "another objective's run folder",
     ["--ds_config", CPU_DS, "--config", DEBUG, "--objective", "mixedae", "--output_dir", "{d}/mae_run",
      "--resume", "auto"], r"--objective mixedae, but --output_dir .*mae_run .* holds a mae run: give --objective mae",
     None),
    ("train.pretrain", "micro-batch larger than the epoch",
     ["--ds_config", "{d}/big_micro.json", "--config", DEBUG, "--output_dir", "{d}/out"],
     r"a train_micro_batch_size_per_gpu of at most 64 \(it sets 100000\)", None),
    ("train.pretrain", "unwritable output", ["--ds_config", CPU_DS, "--config", DEBUG, "--output_dir",
                                             "{d}/a_file/run"], r"--output_dir .*a_file/run cannot be created", None),
    ("train.pretrain", "misspelt option", ["--ds_config", CPU_DS, "--config", DEBUG, "--optim.blrr", "1"],
     r"unknown option 'optim.blrr'; did you mean 'optim.blr'", None),
    ("train.finetune", "malformed preset", ["--ds_config", CPU_DS, "--config", "{d}/malformed.json"],
     r"malformed.json:1:24 is not valid JSON", None),
    ("train.finetune", "missing weights", ["--ds_config", CPU_DS, "--config", DEBUG, "--model.init_from",
                                           "{d}/nowhere.safetensors", "--finetune.num_classes", "10"],
     r"model.init_from .*nowhere.safetensors' does not exist: give an exported encoder.safetensors", None),
    ("train.finetune", "weights of other sizes",
     ["--ds_config", CPU_DS, "--config", DEBUG, "--model.in_chans", "3", "--model.init_from", "{d}/mini.safetensors",
      "--finetune.num_classes", "10", "--output_dir", "{d}/out"],
     r"the file's encoder has width 128 \(the model's: 32\), depth 4 \(the model's: 2\)", None),
    ("train.linprobe", "weights of other input channels",
     ["--ds_config", "ds_configs/cpu_linprobe.json", "--model.name", "vit_debug_patch4", "--model.init_from",
      "{d}/gray.safetensors", "--linprobe.num_classes", "2", "--data.train_index", "{d}/shards/train.json",
      "--output_dir", "{d}/out"], r"input channels 1 \(the model's: 3\)", None),
    ("train.linprobe", "missing preset", ["--ds_config", "ds_configs/cpu_linprobe.json", "--config",
                                          "train/configs/linprobe/mae_recip.json"],
     r"nearest: train/configs/linprobe/mae_recipe.json", None),
    ("train.evaluate", "missing encoder", ["--train_index", "{d}/shards/train.json", "--test_index",
                                           "{d}/held_out/test.json", "--encoder", "{d}/nowhere.safetensors"],
     r"--encoder .*nowhere.safetensors does not exist: give an exported encoder.safetensors", None),
    ("train.evaluate", "encoder of other input channels",
     ["--train_index", "{d}/shards/train.json", "--test_index", "{d}/held_out/test.json", "--encoder",
      "{d}/gray.safetensors"], r"takes 1-channel images, the shards decode to 3-channel RGB", None),
    ("train.evaluate", "size that does not fit the patch",
     ["--train_index", "{d}/shards/train.json", "--test_index", "{d}/held_out/test.json", "--random_init",
      "vit_debug_patch4", "--img_size", "30"], r"img_size 30 is not divisible by patch_size 4 .*--img_size 30: give a "
                                               r"multiple", None),
    ("train.evaluate", "missing checkpoint", ["--train_index", "{d}/shards/train.json", "--test_index",
                                              "{d}/held_out/test.json", "--checkpoint", "{d}/empty"],
     r"--checkpoint .*empty: no complete checkpoint there", None),
    ("train.evaluate", "malformed index", ["--train_index", "{d}/malformed.json", "--test_index",
                                           "{d}/held_out/test.json", "--random_init", "vit_debug_patch4"],
     r"shard index .*malformed.json:1:24 is not valid JSON", None),
    ("train.evaluate", "one training sample", ["--train_index", "{d}/shards/train.json", "--test_index",
                                               "{d}/held_out/test.json", "--random_init", "vit_debug_patch4",
                                               "--max_train", "1", "--num_workers", "0"],
     r"the linear probe would fit on 1 training sample, and standardising its features needs at least 2", None),
    ("train.evaluate", "no encoder", ["--train_index", "{d}/shards/train.json", "--test_index",
                                      "{d}/held_out/test.json"], r"give exactly one of --encoder", None),
    ("train.evaluate", "unwritable output", ["--train_index", "{d}/shards/train.json", "--test_index",
                                             "{d}/held_out/test.json", "--random_init", "vit_debug_patch4", "--out",
                                             "{d}/a_file/eval.json"], r"--out .*cannot be written", None),
    ("train.evaluate", "misspelt option", ["--train_index", "x", "--test_index", "x", "--tset_index", "x"],
     r"unrecognized arguments: --tset_index x \(--help lists the options\)", None),
    ("train.export", "missing run folder", ["--checkpoint", "{d}/no/such/run"],
     r"--checkpoint .*no/such/run does not exist: give a run folder", None),
    ("train.export", "folder without checkpoints", ["--checkpoint", "{d}/empty"],
     r"--checkpoint .*empty: no complete checkpoint there", None),
    ("train.export", "missing option", [], r"the following arguments are required: --checkpoint", None),
    ("train.bench", "malformed preset", ["--ds_config", CPU_DS, "--config", "{d}/malformed.json"],
     r"malformed.json:1:24 is not valid JSON", None),
    ("train.bench", "a GPU's benchmark on a CPU", ["--ds_config", A100, "--model.name", "vit_base_patch16",
                                                   "--data.source", "synthetic", "--out_dir", "{d}/bench"],
     r"TFLOP of matmuls; this CPU multiplies at .* it is sized for a GPU; .*--allow_cpu", "cpu_only"),
    ("train.bench", "unwritable output", ["--ds_config", CPU_DS, "--config", DEBUG, "--out_dir", "{d}/a_file"],
     r"--out_dir .*a_file is a file", None),
    ("train.bench", "bad value", ["--ds_config", CPU_DS, "--config", DEBUG, "--steps", "0"],
     r"--steps must be >= 1", None),
    ("train.bench", "unknown GPU", ["--ds_config", CPU_DS, "--config", DEBUG, "--gpu", "a200"],
     r"--gpu: unknown GPU 'a200'; choose one of \['a100'", None),
    ("train.bench_objectives", "unknown model", ["--device", "cpu", "--model", "vit_nano", "--out_dir", "{d}/bench"],
     r"--model vit_nano is not a registered ViT", None),
    ("train.bench_objectives", "unwritable output", ["--device", "cpu", "--out_dir", "{d}/a_file"],
     r"--out_dir .*a_file is a file", None),
    ("train.bench_objectives", "a GPU's benchmark on a CPU", ["--device", "cpu", "--out_dir", "{d}/bench"],
     r"pairs on vit_base_patch16, batch 128, .* it is sized for a GPU; .*--allow_cpu", None),
    ("kernels.bench", "unwritable output", ["--device", "cpu", "--out_dir", "{d}/a_file"],
     r"--out_dir .*a_file is a file", None),
    ("tools.census", "missing preset", ["--ds_config", CPU_DS, "--config", "train/configs/mae/dbug.json"],
     r"nearest: train/configs/mae/debug.json", None),
    ("tools.census", "unwritable output", ["--ds_config", CPU_DS, "--config", DEBUG, "--json", "{d}/a_file/c.json"],
     r"--json .*cannot be written", None),
    ("tools.census", "bad value", ["--ds_config", CPU_DS, "--config", DEBUG, "--steps", "2"],
     r"--steps must be >= 3", None),
    ("tools.scaling", "missing ds_config", ["--ds_config", "ds_configs/vit_b_8xh100_bf16_zero9.json"],
     r"ds_config 'ds_configs/vit_b_8xh100_bf16_zero9.json' does not exist", None),
    ("tools.scaling", "bad value", ["--ds_config", A100, "--world_size", "x"],
     r"argument --world_size: invalid int value: 'x' \(--help lists the options\)", None),
    ("tools.scaling", "unknown GPU", ["--ds_config", A100, "--gpu", "a200"], r"unknown GPU 'a200'; choose one of", None),
    ("tools.scaling", "no bandwidth", ["--ds_config", A100, "--intra_gbytes_s", "0"],
     r"--intra_gbytes_s and --inter_gbits_s must be > 0, the latencies >= 0", None),
    ("tools.scaling", "negative latency", ["--ds_config", A100, "--intra_latency_us", "-100"],
     r"--intra_gbytes_s and --inter_gbits_s must be > 0, the latencies >= 0", None),
    ("train.convert_checkpoint", "missing run folder", ["{d}/no/such/run"],
     r"no/such/run does not exist; give a tag folder or a run folder", None),
    ("train.convert_checkpoint", "a tag that is not of the earlier layout", ["{d}/current_tag"],
     r"current_tag has no model.pt: it is not a tag of the earlier layout", None),
    ("train.convert_checkpoint", "missing option", [], r"the following arguments are required: TAG", None),
    ("data.write_shards", "missing folder", ["imagefolder", "{d}/no_images", "{d}/out"],
     r"no_images", None),
    ("data.write_shards", "unwritable output", ["imagefolder", "{d}/images", "{d}/a_file"],
     r"output folder .*a_file is a file", None),
    ("data.write_shards", "misspelt option", ["imagefolder", "{d}/images", "{d}/out", "--sampels_per_shard", "4"],
     r"unrecognized arguments", None),
    ("data.index_shards", "missing shards", ["{d}/no_shards/a-{{0..1}}.tar", "--out", "{d}/out.json"],
     r"2 of 2 shards do not exist", None),
    ("data.index_shards", "missing class names", ["{d}/shards", "--out", "{d}/out.json", "--classes",
                                                  "{d}/names.txt"], r"--classes .*names.txt does not exist", None),
    ("data.index_shards", "unwritable output", ["{d}/shards", "--out", "{d}/a_file/i.json"],
     r"--out .*cannot be written", None),
    ("data.verify", "missing index", ["{d}/nowhere.json"], r"shard index .*nowhere.json not found", None),
    ("data.verify", "malformed index", ["{d}/malformed.json"], r"malformed.json:1:24 is not valid JSON", None),
    ("data.verify", "no pixel allowed", ["{d}/shards/train.json", "--max_image_pixels", "0"],
     r"--max_image_pixels must be >= 1 \(got 0, which counts every image as a decompression bomb\)", None),
    ("launchers.submit", "malformed preset", ["--nodes", "1", "--gpus_per_node", "0", "--dry", "--", "--ds_config",
                                              CPU_DS, "--config", "{d}/malformed.json", "--output_dir", "{d}/out"],
     r"not submitted: preset --config .*malformed.json:1:24", None),
    ("launchers.submit", "missing preset", ["--nodes", "1", "--gpus_per_node", "0", "--dry", "--", "--ds_config",
                                            CPU_DS, "--config", "train/configs/mae/debugg.json"],
     r"not submitted: .*nearest: train/configs/mae/debug.json", None),
    ("launchers.submit", "no pretraining options", ["--nodes", "1", "--dry"], r"give the pretraining options after --",
     None),
    ("experiments.fashion_mnist.study", "missing shards", ["--shards", "{d}/no_shards", "--no_report"],
     r"--shards .*no_shards: no train.json and test.json there", None),
    ("experiments.fashion_mnist.study", "unknown entry", ["--only", "mea", "--no_report"], r"unknown entries \['mea'\]",
     None),
    ("experiments.fashion_mnist.study", "no figures for the committed report", ["--shards", "{d}/no_shards"],
     r"matplotlib is not installed.*docs/ is left as it is", no_pyplot),
    ("experiments.fashion_mnist.report", "no figures for the committed report", ["--preset", "full"],
     r"matplotlib is not installed.*docs/ is left as it is", no_pyplot),
    ("experiments.fashion_mnist.report", "missing run folder", ["--runs", "{d}/no_runs", "--docs", "{d}/docs"],
     r"--runs .*no_runs is not a folder", None),
    ("experiments.fashion_mnist.report", "nothing to report", ["--runs", "{d}/runs", "--docs", "{d}/docs"],
     r"no run summaries in .* and no finished run in .*: pass --runs", None),
    ("experiments.fashion_mnist.demo", "unknown method", ["--method", "mea"], r"argument --method: invalid choice",
     None),
    ("experiments.fashion_mnist.demo", "unwritable output", ["--out", "{d}/a_file/run"], r"--out .*cannot be created",
     None),
    # --- untrusted checkpoints and faults during save ---
    ("train.pretrain", "a checkpoint whose state.pt would run code",
     ["--ds_config", CPU_DS, "--config", DEBUG, "--output_dir", "{d}/hostile_state", "--resume", "auto"],
     r"--resume auto: no checkpoint in .*hostile_state/checkpoints can be used \(step00000001: state.pt would unpickle "
     r"\['builtins.open'\]; refused.*start afresh without --resume", None),
    ("train.pretrain", "a checkpoint whose optimizer metadata names os.system under DCP's module",
     ["--ds_config", CPU_DS, "--config", DEBUG, "--output_dir", "{d}/out", "--resume",
      "{d}/hostile_metadata/checkpoints/step00000001"],
     r"optim/.metadata would unpickle torch.distributed.checkpoint.metadata.os.system; refused", None),
    ("train.finetune", "weights from a run whose checkpoint would run code",
     ["--ds_config", CPU_DS, "--config", DEBUG, "--model.init_from", "{d}/hostile_metadata", "--finetune.num_classes",
      "10", "--output_dir", "{d}/out"], r"model.init_from .*hostile_metadata.*optim/.metadata would unpickle", None),
    ("train.export", "a checkpoint whose state.pt would run code", ["--checkpoint", "{d}/hostile_state"],
     r"--checkpoint .*hostile_state: no checkpoint in .* can be used \(step00000001: state.pt would unpickle", None),
    ("train.evaluate", "a checkpoint whose optimizer metadata would run code",
     ["--train_index", "{d}/shards/train.json", "--test_index", "{d}/held_out/test.json", "--checkpoint",
      "{d}/hostile_metadata"], r"--checkpoint .*hostile_metadata: .*optim/.metadata would unpickle", None),
    # --- values: types, ranges, composition ---
    ("train.pretrain", "a number out of its range", ["--ds_config", CPU_DS, "--config", DEBUG, "--seed", "-1",
                                                     "--output_dir", "{d}/out"],
     r"option seed must be in \[0, 2147483647\], got -1 .*; e\.g\. --seed 0", None),
    ("train.pretrain", "a number that is not finite", ["--ds_config", CPU_DS, "--config", DEBUG, "--optim.blr", "inf",
                                                       "--output_dir", "{d}/out"],
     r"option optim.blr must be a finite number, got \"inf\"", None),
    ("train.pretrain", "a boolean that is not true or false", ["--ds_config", CPU_DS, "--config", DEBUG,
                                                              "--run.export", "yes", "--output_dir", "{d}/out"],
     r"option run.export must be true or false, got \"yes\"", None),
    ("train.pretrain", "presets that disagree", ["--ds_config", CPU_DS, "--config", "train/configs/maeplus/debug.json",
                                                 "--config", "train/configs/maeplus/variants/official_code.json",
                                                 "--config", "train/configs/maeplus/variants/rpe_coord.json",
                                                 "--output_dir", "{d}/out"],
     r"the presets .*official_code.json and .*rpe_coord.json set maeplus.adversary to \"ape_embed\" and "
     r"\"rpe_coord\": keep one of them, or give --maeplus.adversary on the command line", None),
    ("train.pretrain", "tensors that cannot be allocated", ["--ds_config", CPU_DS, "--config", DEBUG,
                                                            "--model.img_size", "1000000", "--output_dir", "{d}/out"],
     r"a step needs at least [\d,.]+ GiB per rank .* GiB of this machine's memory: lower model.img_size", "cpu_only"),
    ("train.pretrain", "a world size below one", ["--dry-run", "--world_size", "0", "--ds_config", CPU_DS, "--config",
                                                  DEBUG], r"--world_size must be >= 1, got 0", None),
    ("train.finetune", "a number out of its range", ["--ds_config", CPU_DS, "--config", DEBUG, "--finetune.smoothing",
                                                     "1", "--finetune.num_classes", "10", "--output_dir", "{d}/out"],
     r"option finetune.smoothing must be in \[0, 1\), got 1\.0", None),
    ("train.bench", "a number that is not finite", ["--ds_config", CPU_DS, "--config", DEBUG, "--optim.betas",
                                                    "0.9,nan", "--out_dir", "{d}/bench"],
     r"option optim.betas must be a finite number, got \"nan\"", None),
    ("tools.census", "a number out of its range", ["--ds_config", CPU_DS, "--config", DEBUG, "--model.in_chans", "0"],
     r"option model.in_chans must be >= 1, got 0", None),
    ("launchers.submit", "a number out of its range", ["--nodes", "1", "--gpus_per_node", "0", "--dry", "--",
                                                       "--ds_config", CPU_DS, "--config", DEBUG, "--seed", "-1",
                                                       "--output_dir", "{d}/out"],
     r"not submitted: option seed must be in \[0, 2147483647\], got -1", None),
    # --- weights files, special files, outputs ---
    ("train.pretrain", "random bytes as weights",
     ["--ds_config", CPU_DS, "--config", DEBUG, "--model.init_from", "{d}/bad/random.safetensors", "--output_dir",
      "{d}/out"], r"model.init_from: .*random.safetensors is not a safetensors file, or is truncated in its header: "
                  r"its first 8 bytes give a header of \d+ bytes, the file has 4088 after them; give an exported", None),
    ("train.pretrain", "a FIFO as weights",
     ["--ds_config", CPU_DS, "--config", DEBUG, "--model.init_from", "{d}/bad/fifo.safetensors", "--output_dir",
      "{d}/out"], r"model.init_from: .*fifo.safetensors is a FIFO \(named pipe\), not a regular file; give", None),
    ("train.finetune", "a torch file cut in half as weights",
     ["--ds_config", CPU_DS, "--config", DEBUG, "--model.init_from", "{d}/bad/truncated.pth",
      "--finetune.num_classes", "10", "--output_dir", "{d}/out"],
     r"truncated.pth is truncated or damaged: its zip directory cannot be read .*; give an exported", None),
    ("train.linprobe", "a character device as weights",
     ["--ds_config", "ds_configs/cpu_linprobe.json", "--model.name", "vit_debug_patch4", "--model.init_from",
      "/dev/zero", "--linprobe.num_classes", "2", "--data.train_index", "{d}/shards/train.json", "--output_dir",
      "{d}/out"], r"model.init_from: /dev/zero is a character device, not a regular file; give", None),
    ("train.evaluate", "random bytes as the encoder",
     ["--train_index", "{d}/shards/train.json", "--test_index", "{d}/held_out/test.json", "--encoder",
      "{d}/bad/random.safetensors"], r"--encoder: .*random.safetensors is not a safetensors file.*; give an exported",
     None),
    ("train.evaluate", "an export's description claiming blocks its weights do not hold",
     ["--train_index", "{d}/shards/train.json", "--test_index", "{d}/held_out/test.json", "--encoder",
      "{d}/deep.safetensors"], r"deep.json: timm_kwargs does not describe the weights beside it, which hold 2 blocks, "
                               r"where the model has 10000000: give the .json train.export wrote", None),
    ("train.evaluate", "an export's description with a size in quotes",
     ["--train_index", "{d}/shards/train.json", "--test_index", "{d}/held_out/test.json", "--encoder",
      "{d}/quoted.safetensors"], r"quoted.json: timm_kwargs: depth is '2', not an integer >= 1: give the .json", None),
    ("train.evaluate", "weights numbering a block past the blocks they hold",
     ["--train_index", "{d}/shards/train.json", "--test_index", "{d}/held_out/test.json", "--encoder",
      "{d}/bad/gapped.safetensors", "--num_heads", "2"],
     r"gapped.safetensors: holds 3 blocks numbered 0, 1, 9999999, not 0 to 2 in turn", None),
    ("train.evaluate", "a small torch file claiming a large broadcast tensor",
     ["--train_index", "{d}/shards/train.json", "--test_index", "{d}/held_out/test.json", "--encoder",
      "{d}/bad/broadcast.pth"], r"broadcast.pth: tensor model.w claims 320,000,000 values .* but stores 128", None),
    ("train.linprobe", "a small torch file claiming a large broadcast tensor as weights",
     ["--ds_config", "ds_configs/cpu_linprobe.json", "--model.name", "vit_debug_patch4", "--model.init_from",
      "{d}/bad/broadcast.pth", "--linprobe.num_classes", "2", "--data.train_index", "{d}/shards/train.json",
      "--output_dir", "{d}/out"], r"model.init_from: .*broadcast.pth: tensor model.w claims 320,000,000 values", None),
    ("train.evaluate", "a FIFO as the encoder",
     ["--train_index", "{d}/shards/train.json", "--test_index", "{d}/held_out/test.json", "--encoder",
      "{d}/bad/fifo.safetensors"], r"--encoder .*fifo.safetensors is a FIFO \(named pipe\), not a regular file: give",
     None),
    ("train.evaluate", "--out that is an input",
     ["--train_index", "{d}/shards/train.json", "--test_index", "{d}/held_out/test.json", "--random_init",
      "vit_debug_patch4", "--out", "{d}/shards/train.json", "--overwrite"],
     r"--out .*train.json is the input .*train.json: writing it would destroy the input", None),
    ("train.evaluate", "an existing --out",
     ["--train_index", "{d}/shards/train.json", "--test_index", "{d}/held_out/test.json", "--random_init",
      "vit_debug_patch4", "--out", "{d}/malformed.json"], r"--out .*malformed.json exists already: pass --overwrite",
     None),
    ("train.export", "a checkpoint whose weights are cut short", ["--checkpoint", "{d}/bad_run"],
     r"--checkpoint .*bad_run: .*model.safetensors is truncated in its data.*; export another of the run's", None),
    ("train.export", "--out inside the checkpoint",
     ["--checkpoint", "{d}/bad_run", "--out", "{d}/bad_run/checkpoints/step00000001/model.safetensors",
      "--overwrite"], r"--out .*model.safetensors lies inside the input .*step00000001", None),
    ("train.export", "an existing --out", ["--checkpoint", "{d}/bad_run", "--out", "{d}/mini.safetensors"],
     r"--out .*mini.safetensors exists already: pass --overwrite to replace it", None),
    ("data.index_shards", "--out that is a shard",
     ["{d}/shards", "--out", "{d}/shards/train-000000.tar", "--overwrite"],
     r"--out .*train-000000.tar is the input .*train-000000.tar", None),
    ("data.index_shards", "an existing --out", ["{d}/shards", "--out", "{d}/shards/train.json"],
     r"--out .*train.json exists already: pass --overwrite", None),
    ("data.write_shards", "the input folder as the output",
     ["imagefolder", "{d}/images", "{d}/images", "--overwrite"], r"output folder .*images is the input folder", None),
    ("data.write_shards", "an output folder holding the shards",
     ["imagefolder", "{d}/images", "{d}/shards"], r"output folder .*shards holds train-000000.tar, train.json "
                                                  r"already: pass --overwrite", None),
    ("launchers.submit", "a time limit Slurm does not read",
     ["--nodes", "1", "--gpus_per_node", "0", "--time", "3 days", "--dry", "--", "--ds_config", CPU_DS, "--config",
      DEBUG], r"not submitted: --time '3 days' is not a Slurm time limit: give a positive minutes, .*"
              r"days-hours:minutes:seconds", None),
    ("launchers.submit", "a job name that would break the script",
     ["--nodes", "1", "--gpus_per_node", "0", "--job_name", "mae\n#SBATCH --exclusive", "--dry", "--",
      "--ds_config", CPU_DS, "--config", DEBUG], r"--job_name 'mae\\n#SBATCH --exclusive': give a name without "
                                                 r"control characters", None),
    # --- labels ---
    ("train.evaluate", "a test index of other class names",
     ["--train_index", "{d}/shards/train.json", "--test_index", "{d}/shards/swapped.json", "--random_init",
      "vit_debug_patch4"], r"--test_index .*swapped.json does not fit --train_index .*train.json: label 0 is class "
                           r"'class1' in --test_index and 'class0' in --train_index.*same class list", None),
    ("train.finetune", "an evaluation index of other class names",
     ["--ds_config", CPU_DS, "--config", DEBUG, "--data.source", "shards", "--model.in_chans", "3",
      "--finetune.num_classes", "2", "--data.train_index", "{d}/shards/train.json", "--data.eval_index",
      "{d}/shards/swapped.json", "--output_dir", "{d}/out"],
     r"data.eval_index .*swapped.json does not fit data.train_index .*train.json: label 0 is class 'class1'", None),
    ("train.linprobe", "an evaluation index of other class names",
     ["--ds_config", "ds_configs/cpu_linprobe.json", "--model.name", "vit_debug_patch4", "--linprobe.num_classes", "2",
      "--data.train_index", "{d}/shards/train.json", "--data.eval_index", "{d}/shards/swapped.json", "--output_dir",
      "{d}/out"], r"data.eval_index .*swapped.json does not fit data.train_index .*: label 0 is class 'class1'", None),
    ("data.verify", "an evaluation index of other class names",
     ["{d}/shards/swapped.json", "--train_index", "{d}/shards/train.json"],
     r"the index .*swapped.json does not fit --train_index .*train.json: label 0 is class 'class1'", None),
    ("train.evaluate", "an index entry that climbs out of its folder",
     ["--train_index", "{d}/shards/train.json", "--test_index", "{d}/shards/climbing.json", "--random_init",
      "vit_debug_patch4"], r"climbing.json: entry '\.\./a_file' climbs with '\.\.'.*absolute path", None),
    ("train.pretrain", "an index entry that climbs out of its folder",
     ["--ds_config", CPU_DS, "--config", DEBUG, "--data.source", "shards", "--model.in_chans", "3",
      "--data.train_index", "{d}/shards/climbing.json", "--output_dir", "{d}/out"],
     r"climbing.json: entry '\.\./a_file' climbs with '\.\.'", None),
    ("data.verify", "an index entry that climbs out of its folder", ["{d}/shards/climbing.json"],
     r"climbing.json: entry '\.\./a_file' climbs with '\.\.'", None),
]


def tree(folder: Path) -> dict[str, float]:
    """Every path under `folder`, with its modification time for files (a folder's changes when a
    check makes and removes an entry to see whether it can be written)."""
    return {str(p.relative_to(folder)): p.stat().st_mtime if p.is_file() else 0 for p in folder.rglob("*")}


def run(entry: str, argv: list[str], capsys) -> tuple[int, str, str]:
    """The entry point run as its __main__ block runs it: (exit status, stdout, stderr)."""
    import importlib

    module, wrapper, _ = ENTRY_POINTS[entry]
    main = importlib.import_module(module).main
    capsys.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            wrapper(lambda: main(argv))
            status = 0
        except SystemExit as e:
            status = e.code
    out = capsys.readouterr()
    return status, out.out, out.err


@pytest.mark.parametrize("entry, what, argv, message, setup", CASES, ids=[f"{c[0]}: {c[1]}" for c in CASES])
def test_bad_input_is_refused_in_one_line_before_any_work(inputs, entry, what, argv, message, setup, capsys,
                                                          monkeypatch):
    if setup == "cpu_only":
        if torch.cuda.is_available():
            pytest.skip("a GPU's benchmark runs on this machine")
    elif setup is not None:
        setup(monkeypatch)
    (inputs / "big_micro.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 100000,
                                                       "gradient_accumulation_steps": 1, "gradient_clipping": 0.0}))
    monkeypatch.chdir(REPO)
    before = tree(inputs)
    status, out, err = run(entry, [a.format(d=inputs) for a in argv], capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2, (status, out[-2000:], err[-2000:])
    assert len(lines) == 1 and "Traceback" not in out + err, err[-3000:]
    assert re.search(message, lines[0]), lines[0]
    assert tree(inputs) == before  # nothing written, nothing touched


def test_every_entry_point_is_in_the_table_and_runs_its_main_as_the_table_does():
    """The table's wrapper is the one each module's __main__ block uses, and every entry point of
    train/, data/, launchers/, tools/census.py, kernels/bench.py and the study's commands has a row."""
    covered = {c[0] for c in CASES}
    assert covered == set(ENTRY_POINTS)
    for entry, (_, _, block) in ENTRY_POINTS.items():
        source = (REPO / Path(*entry.split("."))).with_suffix(".py").read_text()
        main_block = source[source.rindex('if __name__ == "__main__":'):]
        assert block in main_block, (entry, main_block)
    commands = {str(p.relative_to(REPO).with_suffix("")).replace("/", ".") for folder in ("train", "data", "launchers")
                for p in (REPO / folder).glob("*.py") if 'if __name__ == "__main__"' in p.read_text()}
    assert commands - set(ENTRY_POINTS) <= {"data.fashion_mnist", "launchers.slurm"}, commands - set(ENTRY_POINTS)


@pytest.mark.parametrize("argv, message", [
    (["train/export.py", "--checkpoint", "no/such/run"], "--checkpoint no/such/run does not exist: give a run folder"),
    (["train/evaluate.py", "--train_index", "{d}/shards/train.json", "--test_index", "{d}/held_out/test.json",
      "--encoder", "{d}/gray.safetensors"], "takes 1-channel images, the shards decode to 3-channel RGB"),
], ids=["export", "evaluate"])
def test_as_scripts_too(inputs, argv, message, tmp_path):
    script, *rest = argv
    proc = subprocess.run([sys.executable, str(REPO / script), *[a.format(d=inputs) for a in rest]], cwd=tmp_path,
                          capture_output=True,
                          text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"}, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr[-2000:]
    assert not list(tmp_path.iterdir())
