"""Inputs that used to be accepted silently, each refused before start with the fix named (exit 2,
nothing written), or made to take effect: ds_config keys (typos at any depth, DeepSpeed settings
the engine does not implement), options nothing of the run reads, output places that cannot be
written, messages that now name the fix, and the smaller cases (export permissions, a short run
over the unusable-sample limit, the dry run for CPU ranks, the linear probe's CPU ds_config)."""
import json
import os
import stat
import subprocess
import sys

import pytest
import torch
from conftest import CPU_DS, DEBUG_PRESET, REPO, run_pretrain

from train.config.ds_config import resolve
from train.config.ds_keys import check_keys
from train.config.errors import ConfigError
from train.config.parsing import parse_args

A100 = REPO / "ds_configs" / "vit_b_8xa100_bf16_zero1.json"
PRESETS = REPO / "train" / "configs"


def with_ds(tmp_path, ds: dict, name: str = "ds.json"):
    path = tmp_path / name
    path.write_text(json.dumps(ds))
    return path


def dry_run(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, str(REPO / "train" / "pretrain.py"), "--dry-run", *argv], cwd=REPO,
                          capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.parametrize("change,message", [
    (lambda d: {**{k: v for k, v in d.items() if k != "bf16"}, "bf_16": {"enabled": True}},
     "key 'bf_16' is not a DeepSpeed setting; did you mean 'bf16'?"),
    (lambda d: {**{k: v for k, v in d.items() if k != "zero_optimization"}, "zero_optimisation": {"stage": 1}},
     "did you mean 'zero_optimization'?"),
    (lambda d: {**d, "zero_optimization": {"stage": 1, "overlap_com": True}},
     "zero_optimization.overlap_com is not a DeepSpeed setting; did you mean 'overlap_comm'?"),
    (lambda d: {**d, "bf16": {"enabeld": True}}, "bf16.enabeld is not a DeepSpeed setting; did you mean 'enabled'?"),
    (lambda d: {("train_micro_batch_size_per_gp" if k == "train_micro_batch_size_per_gpu" else k): v
                for k, v in d.items()}, "did you mean 'train_micro_batch_size_per_gpu'?"),
    (lambda d: {**d, "zero_optimization": {"stage": 1, "reduce_bucket_size": 5e8}},
     "reduce_bucket_size = 500000000.0 would not take effect: ZeRO stages 1-3 run on FSDP2"),
    (lambda d: {**d, "communication_data_type": "int8"}, "communication_data_type 'int8' is not one of fp32, bf16"),
    (lambda d: {**d, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
     "offload_optimizer .* would not take effect: FSDP2's CPU offload would move"),
    (lambda d: {**d, "steps_per_print": 100}, "steps_per_print = 100 would not take effect"),
])
def test_ds_config_keys_are_checked_before_start_by_the_dry_run_and_submit(tmp_path, change, message, capsys):
    from train.pretrain import main
    from train.run.cli import cli

    ds = with_ds(tmp_path, change(json.loads(A100.read_text())))
    with pytest.raises(SystemExit) as status:
        cli(lambda: main(["--dry-run", "--world_size", "8", "--gpu", "a100", "--ds_config", str(ds), "--model.name",
                          "vit_base_patch16", "--data.source", "synthetic"]))
    out = capsys.readouterr()
    assert status.value.code == 2 and re_search(message, out.out + out.err), out
    from launchers.submit import main as submit

    assert submit(["--nodes", "2", "--gpu", "a100", "--dry", "--", "--ds_config", str(ds), "--model.name",
                   "vit_base_patch16", "--data.source", "synthetic", "--output_dir", str(tmp_path / "run")]) == 2
    assert not (tmp_path / "run").exists()


def re_search(pattern: str, text: str) -> bool:
    import re

    return re.search(pattern, text) is not None


def test_what_the_engine_does_anyway_is_accepted_and_every_shipped_file_passes(tmp_path):
    ds = json.loads(A100.read_text())
    ds.update(wall_clock_breakdown=False, timers={"throughput": {"enabled": False}})
    ds["zero_optimization"].update(overlap_comm=False, contiguous_gradients=True)  # DDP and FSDP2 overlap anyway
    final, plan = resolve(parse_args(["--ds_config", str(with_ds(tmp_path, ds)), "--data.source", "synthetic"]), 8,
                          cuda=True, bf16_ok=True)
    assert final["zero_optimization"]["overlap_comm"] is False and final["wall_clock_breakdown"] is False
    assert plan.global_batch == ds["train_batch_size"]
    shipped = sorted((REPO / "ds_configs").glob("*.json"))
    assert len(shipped) >= 10, shipped
    for path in shipped:
        check_keys(json.loads(path.read_text()))  # raises ConfigError naming a refused key


def test_the_start_line_meta_json_and_dry_run_state_stage_precision_reduce_dtype_and_overlap(tmp_path):
    proc = run_pretrain(tmp_path / "run", "--run.max_steps", "1")
    assert "cpu, float32, ZeRO stage 2, offload none, global batch 8" in proc.stderr
    assert "engine: one rank, no wrapper (ZeRO-2: nothing to shard, no communication)" in proc.stderr
    meta = json.loads((tmp_path / "run" / "meta.json").read_text())
    assert (meta["zero_stage"], meta["precision"], meta["offload"], meta["reduce_dtype"]) == (2, "float32", "none",
                                                                                                "fp32")
    out = dry_run("--world_size", "8", "--ds_config", str(A100), "--model.name", "vit_base_patch16",
                  "--data.source", "synthetic").stdout
    assert "bf16; ZeRO 1; offload none;" in out
    # DeepSpeed's default for bf16 training: gradients reduced in bf16; FSDP2 reduces inside the backward
    assert ("engine: ZeRO-1 on FSDP2 (8 ranks, one unit per transformer block + the root): gradients "
            "reduce-scattered in bf16 block by block inside the backward") in out
    fp32_reduce = with_ds(tmp_path, {**json.loads(A100.read_text()), "communication_data_type": "fp32",
                                     "zero_optimization": {"stage": 0, "reduce_bucket_size": 5e7}})
    out = dry_run("--world_size", "8", "--ds_config", str(fp32_reduce), "--model.name", "vit_base_patch16",
                  "--data.source", "synthetic").stdout
    assert "engine: ZeRO-0 on DDP (8 ranks): gradients all-reduced in fp32, 95.3674 MiB buckets issued inside" in out


@pytest.mark.parametrize("argv,message", [
    (["--data.source", "synthetic", "--data.train_index", "shards/pets/train.json"],
     "--data.train_index .set on the command line. is read only with --data.source shards"),
    (["--config", str(DEBUG_PRESET), "--mixedae.cell_size", "8"], "--mixedae.cell_size .* is read only by "
                                                                   "--objective mixedae, and this run's objective is mae"),
    (["--config", str(DEBUG_PRESET), "--mlomae.mask_ratio", "0.5"], "read only by --objective mlomae"),
    (["--config", str(DEBUG_PRESET), "--finetune.num_classes", "3"], "read only by --objective finetune"),
    (["--config", str(DEBUG_PRESET), "--data.num_crops", "2"], "read only with --data.train_transform multicrop"),
    (["--config", str(DEBUG_PRESET), "--config", str(PRESETS / "mixedae/variants/naive_mixing.json")],
     "set by the preset .*naive_mixing.json. is read only by --objective mixedae"),
])
def test_an_option_nothing_would_read_is_refused(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse_args(["--ds_config", str(CPU_DS), *argv])


def test_a_preset_setting_num_crops_without_multicrop_is_refused_as_the_command_line_is(tmp_path):
    """data.num_crops belongs to the multicrop transform, not to a data source: unread whoever sets it."""
    crops = tmp_path / "crops.json"
    crops.write_text(json.dumps({"data": {"num_crops": 2}}))
    with pytest.raises(ConfigError, match=r"--data.num_crops \(set by the preset .*crops.json\) is read only with "
                                          r"--data.train_transform multicrop"):
        parse_args(["--ds_config", str(CPU_DS), "--config", str(DEBUG_PRESET), "--config", str(crops)])


def test_presets_keep_working_and_if_objective_sections_apply_to_their_objective_only():
    for preset in sorted(PRESETS.glob("*/*.json")):
        cfg = parse_args(["--ds_config", str(CPU_DS), "--config", str(preset), "--data.source", "synthetic"])
        assert cfg.objective == json.loads(preset.read_text()).get("objective", "mae"), preset
    mae = parse_args(["--ds_config", str(CPU_DS), "--config", str(DEBUG_PRESET)])
    assert mae.mae.decoder_dim == 32  # mae/debug.json's if_objective section
    other = parse_args(["--ds_config", str(CPU_DS), "--config", str(DEBUG_PRESET), "--config",
                        str(PRESETS / "mixedae/debug.json")])
    assert other.objective == "mixedae" and other.mae.decoder_dim == type(other.mae)().decoder_dim
    # a data option of the shards' pipeline set by a preset stays unread on synthetic images: the recipe's
    vit_b = parse_args(["--ds_config", str(CPU_DS), "--config", str(PRESETS / "mixedae/vit_b.json"), "--data.source",
                        "synthetic"])
    assert vit_b.data.crop_scale_min == 0.2


def test_a_benchmark_refuses_what_it_would_ignore(capsys):
    from train.bench import main

    with pytest.raises(ConfigError, match="--run.ckpt_every .* is not read by this command: a benchmark writes no"):
        main(["--ds_config", str(CPU_DS), "--config", str(DEBUG_PRESET), "--run.ckpt_every", "5"])


@pytest.mark.parametrize("where,message", [
    ("a_file", "is a file, not a folder"),
    ("a_file/run", "cannot be created, "),
    ("/proc/vitpretrain_run", "cannot be written: /proc refuses a new entry"),
])
def test_output_places_that_cannot_be_written_are_refused_before_start(tmp_path, where, message, capsys):
    from train.pretrain import main
    from train.run.cli import cli

    (tmp_path / "a_file").write_text("not a folder")
    out = where if where.startswith("/") else str(tmp_path / where)
    with pytest.raises(SystemExit) as status:
        cli(lambda: main(["--ds_config", str(CPU_DS), "--config", str(DEBUG_PRESET), "--output_dir", out,
                          "--run.max_steps", "1"]))
    err = capsys.readouterr().err
    assert status.value.code == 2 and message in err and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]  # nothing written
    assert not torch.distributed.is_initialized()  # refused before any process group


def test_messages_name_the_fix(tmp_path, rgb_shards):
    from train.run.prestart import check_before_start

    # named by the key the file sets: the micro-batch here, the global batch in a file that gives it
    with pytest.raises(ConfigError, match=r"smaller than the global batch 8 .* give a ds_config with a "
                                          r"train_micro_batch_size_per_gpu of at most 4 \(it sets 8\), or more samples"):
        check_before_start(parse_args(["--ds_config", str(CPU_DS), "--config", str(DEBUG_PRESET), "--data.epoch_size",
                                       "4", "--output_dir", str(tmp_path / "a")]))
    ds = with_ds(tmp_path, {**json.loads(CPU_DS.read_text()), "train_batch_size": 8})
    with pytest.raises(ConfigError, match="give a ds_config with a train_batch_size of at most 4, or more samples"):
        check_before_start(parse_args(["--ds_config", str(ds), "--config", str(DEBUG_PRESET), "--data.epoch_size",
                                       "4", "--output_dir", str(tmp_path / "a")]))
    proc = run_pretrain(tmp_path / "b", "--data.source", "shards", "--data.train_index", str(rgb_shards.parent),
                        "--model.in_chans", "3", check=False)
    assert proc.returncode == 2 and "is a folder (it holds train.json): give the index file itself" in proc.stderr
    from data.shard_index import ShardSet, check_split

    with pytest.raises(ValueError, match=r"cannot feed 8 ranks \(each reads in its own process with "
                                         r"--data.num_workers 0\) = 8 readers.*smaller --samples_per_shard\)$"):
        check_split(ShardSet.from_index(rgb_shards), 8, 0)


def test_resuming_another_objective_names_both_ways_on(tmp_path):
    run_pretrain(tmp_path, "--run.max_steps", "1")
    proc = run_pretrain(tmp_path, "--run.max_steps", "2", "--resume", "auto", "--config",
                        str(PRESETS / "mixedae/debug.json"), check=False)
    assert proc.returncode == 2  # named before the objective's own checks (MixedAE's cells) could blame its options
    assert f"--objective mixedae, but --output_dir {tmp_path} (its config.json) holds a mae run: give --objective mae " \
           "to continue it, or another --output_dir for the mixedae run (--model.init_from starts it from that " \
           "run's weights)" in proc.stderr


def test_an_exported_encoder_is_readable_as_the_umask_says(tmp_path):
    old = os.umask(0o022)
    try:
        run_pretrain(tmp_path, "--run.max_steps", "1")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "encoder.safetensors").stat().st_mode) == 0o644


def test_a_short_run_over_the_unusable_sample_limit_ends_before_the_last_checkpoint(tmp_path, image_folder):
    """Two shards of 12 samples, 2 undecodable in each: a reader applies the limit only once it has
    seen a shard's worth of samples, which 2 steps of 2 samples never reach; the run's end applies it."""
    import io
    import tarfile

    from data.write_shards import main as write_shards

    [index] = write_shards(["imagefolder", str(image_folder), str(tmp_path / "shards"), "--samples_per_shard", "12"])
    for shard in sorted((tmp_path / "shards").glob("*.tar")):  # the first 2 images of each shard made unreadable
        with tarfile.open(shard) as tar:
            members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
        spoiled = 0
        with tarfile.open(shard, "w") as tar:
            for m, data in members:
                if spoiled < 2 and m.name.endswith((".jpg", ".png")):
                    data, spoiled = b"not an image" * 10, spoiled + 1
                    m.size = len(data)
                tar.addfile(m, io.BytesIO(data))
    ds = with_ds(tmp_path, {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                            "gradient_clipping": 0.0, "zero_optimization": {"stage": 0}})
    proc = run_pretrain(tmp_path / "run", "--data.source", "shards", "--data.train_index",
                        str(tmp_path / "shards" / f"{index['name']}.json"), "--model.in_chans", "3",
                        "--data.num_workers", "0", "--data.shuffle_buffer", "1", "--run.max_steps", "2",
                        "--data.epoch_size", "0", ds_config=ds,
                        check=False)
    assert proc.returncode == 3 and "above data.max_bad_fraction 0.01" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "run" / "encoder.safetensors").exists()
    assert not (tmp_path / "run" / "checkpoints" / "step00000002").exists()  # the last step's checkpoint not written


def test_the_dry_run_checks_cpu_ranks_and_the_linear_probe_has_a_cpu_ds_config(tmp_path):
    proc = dry_run("--world_size", "2", "--gpu", "cpu", "--ds_config", str(CPU_DS), "--config", str(DEBUG_PRESET))
    assert proc.returncode == 0 and "2 x CPU: global batch 16" in proc.stdout
    encoder_run = tmp_path / "mae"
    run_pretrain(encoder_run, "--run.max_steps", "1")
    proc = subprocess.run([sys.executable, str(REPO / "train" / "linprobe.py"), "--ds_config",
                           str(REPO / "ds_configs" / "cpu_linprobe.json"), "--config", str(DEBUG_PRESET),
                           "--model.init_from", str(encoder_run / "encoder.safetensors"), "--linprobe.num_classes",
                           "10", "--data.epoch_size", "256", "--run.max_steps", "1", "--run.progress", "false",
                           "--output_dir",
                           str(tmp_path / "probe")], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "no weight decay (optim.weight_decay 0)" in proc.stderr and "weight decay on" not in proc.stderr
    assert torch.isfinite(torch.tensor(
        json.loads((tmp_path / "probe" / "metrics.jsonl").read_text().splitlines()[-1])["loss"]))


def test_the_shard_writer_checks_its_output_folder_names_bad_files_and_skips_non_images(tmp_path, image_folder,
                                                                                          capsys):
    from data.write_shards import main as write_shards

    (tmp_path / "a_file").write_text("not a folder")
    with pytest.raises(SystemExit) as status:
        write_shards(["imagefolder", str(image_folder), str(tmp_path / "a_file")])
    assert status.value.code == 2 and "output folder" in capsys.readouterr().err
    for name in ("a/b", "", ".hidden", "../up", "pets.v2"):  # a file name in the output folder, without a dot
        with pytest.raises(SystemExit) as status:
            write_shards(["imagefolder", str(image_folder), str(tmp_path / "named"), "--name", name])
        err = capsys.readouterr().err
        assert status.value.code == 2 and f"--name {name!r}: the shards' and index's file name" in err, err
        assert "Traceback" not in err and not (tmp_path / "named").exists()
    (image_folder / "cat" / "README.txt").write_text("where these images come from")
    (image_folder / "dog" / ".DS_Store").write_bytes(b"\0\1")
    [index] = write_shards(["imagefolder", str(image_folder), str(tmp_path / "shards")])
    assert index["num_samples"] == 24  # the 24 images; the two other files left out, and said so
    assert "2 file(s) left out, their names being no image format's" in capsys.readouterr().out
    (image_folder / "eel" / "broken.jpg").write_bytes(b"garbage")
    with pytest.raises(SystemExit):
        write_shards(["imagefolder", str(image_folder), str(tmp_path / "shards2")])
    err = capsys.readouterr().err
    assert f"{image_folder / 'eel' / 'broken.jpg'}: UnidentifiedImageError: not an image" in err
    assert "BytesIO" not in err
