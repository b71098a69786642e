"""Resuming with changed options: those that break the resume stay refused; the others are said
at start, one line each, and recorded in the run folder's resumes.jsonl with the step."""
import json

import pytest
from conftest import CPU_DS, DEBUG_PRESET, run_pretrain

from train.config.errors import ConfigError
from train.config.parsing import parse_args
from train.run.folder import read_metrics
from train.run.prestart import check_before_start


def test_a_resume_with_another_lr_is_said_and_recorded_and_another_model_refused(tmp_path):
    run_pretrain(tmp_path, "--run.max_steps", "2", "--run.ckpt_every", "2")
    another_model = parse_args(["--ds_config", str(CPU_DS), "--config", str(DEBUG_PRESET), "--output_dir",
                                str(tmp_path), "--resume", "auto", "--model.drop_path_rate", "0.1"])
    with pytest.raises(ConfigError, match=r"--resume: the checkpoint was trained with model.drop_path_rate 0.0, this "
                                          r"run has 0.1; to continue that run, give the same again"):
        check_before_start(another_model)  # the main entry turns it into exit 2
    assert not (tmp_path / "resumes.jsonl").exists()  # refused before anything was written
    proc = run_pretrain(tmp_path, "--resume", "auto", "--run.max_steps", "3", "--run.ckpt_every", "2", "--optim.blr", "3e-3")
    assert "resumed with optim.blr changed: 0.0015 -> 0.003" in proc.stderr
    assert "resumed with run.max_steps changed: 2 -> 3" in proc.stderr
    records = [json.loads(line) for line in (tmp_path / "resumes.jsonl").read_text().splitlines()]
    assert len(records) == 1 and records[0]["step"] == 2
    assert records[0]["changes"] == {"optim.blr": [0.0015, 0.003], "run.max_steps": [2, 3]}
    assert records[0]["from"].endswith("step00000002")
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    assert json.loads((tmp_path / "config.json").read_text())["optim"]["blr"] == 3e-3  # the newest config


def test_another_global_batch_on_the_same_ranks_is_refused():
    from train.config.ds_config import BatchPlan
    from train.config.parsing import to_dict
    from train.run.build import check_resume_compatible

    cfg = parse_args(["--ds_config", str(CPU_DS), "--config", str(DEBUG_PRESET)])
    meta = {"world_size": 1, "global_batch": 16, "config": json.loads(json.dumps(to_dict(cfg)))}
    check_resume_compatible(meta, cfg, BatchPlan(micro=16, accum=1, world=1))  # the same batch: fine
    with pytest.raises(ConfigError, match="global batch 16, this run has 32"):
        check_resume_compatible(meta, cfg, BatchPlan(micro=16, accum=2, world=1))


def test_a_resume_with_another_option_of_the_objective_is_refused():
    """The objective's own section (here mae) is compared like the model's: another mask ratio
    trains another objective."""
    from train.config.ds_config import BatchPlan
    from train.config.parsing import to_dict
    from train.run.build import check_resume_compatible

    base = ["--ds_config", str(CPU_DS), "--config", str(DEBUG_PRESET)]
    meta = {"world_size": 1, "global_batch": 8, "config": json.loads(json.dumps(to_dict(parse_args(base))))}
    plan = BatchPlan(micro=8, accum=1, world=1)
    check_resume_compatible(meta, parse_args(base), plan)  # the same options: fine
    with pytest.raises(ConfigError, match=r"trained with mae.mask_ratio 0.75, this run has 0.5"):
        check_resume_compatible(meta, parse_args([*base, "--mae.mask_ratio", "0.5"]), plan)


@pytest.mark.parametrize("changed, has", [
    (["--model.name", "vit_mini_patch4"], "width 32 (the model's: 128), depth 2 (the model's: 4)"),
    (["--model.in_chans", "3"], "input channels 1 (the model's: 3)"),
    (["--model.rpe", "true"], "no blocks.0.attn.rpe.table, blocks.1.attn.rpe.table (the model's)"),
])
def test_a_resume_with_another_architecture_suggests_a_new_folder_not_its_weights(changed, has):
    """The checkpoint's encoder cannot load into a model of another size, input or iRPE tables, so
    the way to train that model is another --output_dir, not --model.init_from <the checkpoint>."""
    from train.config.ds_config import BatchPlan
    from train.config.parsing import to_dict
    from train.run.build import check_resume_compatible

    base = ["--ds_config", str(CPU_DS), "--config", str(DEBUG_PRESET)]
    meta = {"world_size": 1, "global_batch": 8, "config": json.loads(json.dumps(to_dict(parse_args(base))))}
    with pytest.raises(ConfigError) as refused:
        check_resume_compatible(meta, parse_args([*base, *changed]), BatchPlan(micro=8, accum=1, world=1))
    said = str(refused.value)
    assert "to continue that run, give the same again; to train this model, start it in another --output_dir (the " \
           "checkpoint's encoder does not load into it: --model.init_from takes an encoder of the same architecture, " \
           f"and this one has {has})" in said
    assert "--model.init_from <the checkpoint>" not in said


@pytest.mark.parametrize("changed", [["--model.drop_path_rate", "0.1"], ["--model.img_size", "32"],
                                     ["--model.global_pool", "avg"], ["--mae.mask_ratio", "0.5"]])
def test_a_resume_with_options_the_weights_still_fit_suggests_them_in_a_new_folder(changed):
    """Stochastic depth, another resolution (the position table is resized), average pooling (fc_norm
    starts fresh) or another mask ratio: the checkpoint's encoder loads with --model.init_from."""
    from train.config.ds_config import BatchPlan
    from train.config.parsing import to_dict
    from train.run.build import check_resume_compatible

    base = ["--ds_config", str(CPU_DS), "--config", str(DEBUG_PRESET)]
    meta = {"world_size": 1, "global_batch": 8, "config": json.loads(json.dumps(to_dict(parse_args(base))))}
    with pytest.raises(ConfigError, match=r"to continue that run, give the same again; to train this one from the "
                                          r"checkpoint's weights, start it in another --output_dir with "
                                          r"--model.init_from <the checkpoint>$"):
        check_resume_compatible(meta, parse_args([*base, *changed]), BatchPlan(micro=8, accum=1, world=1))


def test_a_resume_may_change_the_attention_kernel_and_needs_no_init_weights(tmp_path):
    """A run started from --model.init_from resumes after that file is gone (a requeue after a
    clean-up) and without the option; the attention kernel (same function) may change: said and
    recorded. Both were refused with the whole model section."""
    start = tmp_path / "start"
    run_pretrain(start, "--run.max_steps", "1")
    init = tmp_path / "init.safetensors"
    (start / "encoder.safetensors").rename(init)
    run = tmp_path / "run"
    run_pretrain(run, "--run.max_steps", "2", "--run.ckpt_every", "2", "--model.init_from", str(init))
    init.unlink()
    proc = run_pretrain(run, "--resume", "auto", "--run.max_steps", "3", "--model.init_from", str(init),
                        "--model.attn_backend", "math")
    assert f"model.init_from {init} not read: the resumed checkpoint holds every weight" in proc.stderr
    assert 'resumed with model.attn_backend changed: "auto" -> "math"' in proc.stderr
    proc = run_pretrain(run, "--resume", "auto", "--run.max_steps", "4")
    assert f'resumed with model.init_from changed: "{init}" -> ""' in proc.stderr
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3, 4]
    records = [json.loads(line)["changes"] for line in (run / "resumes.jsonl").read_text().splitlines()]
    assert records[0]["model.attn_backend"] == ["auto", "math"] and records[1]["model.init_from"] == [str(init), ""]


def test_a_checkpoint_of_another_folder_does_not_continue_over_a_run_that_trained(tmp_path):
    """--resume <another run's tag> --output_dir <a folder where a run trained> cut that run's
    metrics.jsonl back, replaced its config and checkpoints and left its later tags beside: exit 0."""
    source, held = tmp_path / "source", tmp_path / "held"
    run_pretrain(source, "--run.max_steps", "2", "--run.ckpt_every", "2")
    run_pretrain(held, "--run.max_steps", "4", "--run.ckpt_every", "2", "--optim.blr", "3e-3")
    before = {p: p.read_bytes() for p in held.rglob("*") if p.is_file()}
    proc = run_pretrain(held, "--resume", str(source / "checkpoints" / "step00000002"), "--run.max_steps", "3",
                        check=False)
    assert proc.returncode == 2, proc.stderr
    assert (f"output_dir {held} holds the checkpoints of a run (step00000004 ...), and --resume "
            f"{source / 'checkpoints' / 'step00000002'} is a checkpoint of another folder") in proc.stderr
    assert {p: p.read_bytes() for p in held.rglob("*") if p.is_file()} == before
    run_pretrain(tmp_path / "new", "--resume", str(source / "checkpoints" / "step00000002"), "--run.max_steps", "3")
    assert [r["step"] for r in read_metrics(tmp_path / "new")] == [3]  # a new folder: continued there


def test_a_resume_with_the_ds_configs_contents_changed_says_so(tmp_path):
    """The same ds_config path with other contents (clipping off, another micro-batch split): the
    resume said nothing and the run folder's ds_config.json then described every step."""
    edited = tmp_path / "ds.json"
    ds = json.loads(CPU_DS.read_text())
    edited.write_text(json.dumps(ds))
    run = tmp_path / "run"
    run_pretrain(run, "--run.max_steps", "2", "--run.ckpt_every", "2", ds_config=edited)
    micro = ds["train_micro_batch_size_per_gpu"]
    edited.write_text(json.dumps({**ds, "gradient_clipping": 0.5, "train_micro_batch_size_per_gpu": micro // 2,
                                  "gradient_accumulation_steps": 2}))
    proc = run_pretrain(run, "--resume", "auto", "--run.max_steps", "3", ds_config=edited)
    assert f'resumed with ds_config.gradient_clipping changed: {json.dumps(ds["gradient_clipping"])} -> 0.5' \
        in proc.stderr
    [record] = [json.loads(line) for line in (run / "resumes.jsonl").read_text().splitlines()]
    assert record["changes"]["ds_config.train_micro_batch_size_per_gpu"] == [micro, micro // 2]
    assert record["changes"]["ds_config.gradient_accumulation_steps"] == [1, 2]
