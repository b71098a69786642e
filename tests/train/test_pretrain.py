"""train/pretrain.py end to end as a single process: run folder, resume exactness, rejection."""
import json
import re

import pytest
import torch
from conftest import CPU_DS, run_pretrain

from train.engine.optim import warmup_cosine
from train.engine.state_files import read_tensors
from train.run.folder import read_metrics

STEPS = 6


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    # with figures every 3 steps: the resume test below compares against this run, which also
    # shows that drawing figures leaves the training stream untouched
    run_pretrain(out, "--run.max_steps", str(STEPS), "--run.ckpt_every", "3", "--run.vis_every", "3")
    return out


def test_run_folder_contents(straight):
    for name in ["config.json", "ds_config.json", "meta.json", "metrics.jsonl", "encoder.safetensors", "encoder.json"]:
        assert (straight / name).is_file(), name
    assert list((straight / "tb").glob("events.out.tfevents.*"))
    config = json.loads((straight / "config.json").read_text())
    assert config["model"]["name"] == "vit_debug_patch4" and config["run"]["max_steps"] == STEPS
    ds = json.loads((straight / "ds_config.json").read_text())
    assert ds["train_batch_size"] == 8 and ds["gradient_clipping"] == 0.0
    meta = json.loads((straight / "meta.json").read_text())
    assert len(meta["git"]["commit"]) == 40 or meta["git"]["commit"] == "unknown"
    assert meta["peak_lr"] == pytest.approx(1.5e-3 * 8 / 256)  # lr = blr x global batch / 256
    assert meta["attention_backend"] == "sdpa"


def test_figures_written_every_vis_every_steps(straight):
    from PIL import Image

    names = sorted(p.name for p in (straight / "vis").iterdir())
    assert names == [f"{kind}_step{s:08d}.png" for kind in ("cls_attention", "mae_reconstruction") for s in (3, 6)]
    width, height = Image.open(straight / "vis" / "mae_reconstruction_step00000006.png").size
    assert width > height > 0  # 8 images across, 4 rows


def test_metrics_lines(straight):
    rows = read_metrics(straight)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    meta = json.loads((straight / "meta.json").read_text())
    for r in rows:
        assert {"loss", "lr", "grad_norm", "images_per_s", "step_time"} <= set(r)
        assert r["grad_norm"] > 0 and r["images_per_s"] > 0
        # the lr logged for step s is the one the optimizer used: schedule at s-1
        assert r["lr"] == pytest.approx(warmup_cosine(r["step"] - 1, meta["peak_lr"], 0.0,
                                                      meta["steps_per_epoch"] * 1, meta["total_steps"]))


def test_checkpoints_are_complete_and_pointed_to(straight):
    root = straight / "checkpoints"
    assert (root / "latest").read_text() == "step00000006"
    for tag in ("step00000003", "step00000006"):
        meta = json.loads((root / tag / "complete.json").read_text())
        assert meta["step"] == int(tag[4:]) and meta["world_size"] == 1
        assert (root / tag / "rng_rank0.pt").is_file()
    saved = torch.load(root / "step00000003" / "state.pt", weights_only=True)
    client = saved["client"]
    assert client["step"] == 3 and client["data"] == [{"position": 3, "rank": 0, "seed": 0}]
    assert saved["engine"]["schedule"] == {"last_step": 3} and saved["engine"]["steps"] == 3


def test_resume_auto_continues_exactly(straight, tmp_path):
    # Steps 1-5 run, but the save at step 5 "crashed": its tag lacks complete.json while
    # `latest` names it. Resume must take step 3 and log steps 4-6 once each.
    run_pretrain(tmp_path, "--run.max_steps", "5", "--run.ckpt_every", "3")
    (tmp_path / "checkpoints" / "step00000005" / "complete.json").unlink()
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step00000005"
    proc = run_pretrain(tmp_path, "--run.max_steps", str(STEPS), "--run.ckpt_every", "3", "--resume", "auto")
    assert "step00000003 at step 3" in proc.stderr + proc.stdout
    resumed = read_metrics(tmp_path)
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    want = {r["step"]: r for r in read_metrics(straight)}
    for r in resumed[3:]:
        assert r["loss"] == want[r["step"]]["loss"], r["step"]
        assert r["grad_norm"] == pytest.approx(want[r["step"]]["grad_norm"], rel=1e-6)
        assert r["lr"] == want[r["step"]]["lr"]


def test_resume_rejects_a_different_model(straight, tmp_path):
    proc = run_pretrain(tmp_path, "--resume", str(straight), "--model.name", "vit_mini_patch4", check=False)
    assert proc.returncode == 2 and "the checkpoint was trained with model.name 'vit_debug_patch4', this run has " \
                                    "'vit_mini_patch4'" in proc.stderr
    assert not tmp_path.joinpath("config.json").exists()  # rejected before anything started


@pytest.mark.parametrize("args,message", [
    (["--optim.bl", "1"], "did you mean 'optim.blr'"),
    (["--data.epoch_size", "4"], "smaller than the global batch"),
])
def test_bad_config_rejected_before_training(tmp_path, args, message):
    out = tmp_path / "run"
    proc = run_pretrain(out, *args, check=False)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert not out.exists()  # nothing started, nothing written


def test_bad_ds_config_rejected_before_training(tmp_path):
    ds = tmp_path / "fp16.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                              "gradient_clipping": 0.0, "fp16": {"enabled": True}}))
    proc = run_pretrain(tmp_path / "run", ds_config=ds, check=False)
    if torch.cuda.is_available():
        pytest.skip("fp16 is valid with CUDA")
    assert proc.returncode == 2 and "needs CUDA" in proc.stderr and not (tmp_path / "run").exists()


def test_continued_pretraining_from_an_official_mae_checkpoint(straight, tmp_path):
    """Official layout {"model": flat names incl. decoder} -> --model.init_from: step 1 starts from it."""
    module = read_tensors(straight / "checkpoints" / "step00000006")
    official = {"model": {k.removeprefix("encoder.").removeprefix("decoder."): v for k, v in module.items()}}
    torch.save(official, tmp_path / "mae_pretrain.pth")
    run_pretrain(tmp_path / "run", "--model.init_from", str(tmp_path / "mae_pretrain.pth"), "--run.max_steps", "1")
    # the first step has lr 0 (warmup from 0), so the step-1 weights are exactly the imported ones
    after = read_tensors(tmp_path / "run" / "checkpoints" / "step00000001")
    for k, v in module.items():
        assert torch.equal(after[k], v), k
    assert read_metrics(tmp_path / "run")[0]["loss"] != read_metrics(straight)[0]["loss"]
    bad = {"model": {k: v for k, v in official["model"].items() if k != "norm.weight"}}
    torch.save(bad, tmp_path / "broken.pth")
    proc = run_pretrain(tmp_path / "run2", "--model.init_from", str(tmp_path / "broken.pth"), check=False)
    assert proc.returncode == 2 and "does not fit the configured encoder" in proc.stderr


def test_resume_accepts_options_added_since_the_checkpoint_at_their_defaults():
    """A checkpoint written before an option existed (e.g. model.rpe) resumes when the option is
    at its default, and is refused when the run sets it otherwise."""
    from train.config.ds_config import BatchPlan
    from train.config.errors import ConfigError
    from train.config.options import PretrainConfig
    from train.config.parsing import to_dict
    from train.run.build import check_resume_compatible

    cfg, plan = PretrainConfig(ds_config="x.json"), BatchPlan(8, 1, 1)
    saved = json.loads(json.dumps(to_dict(cfg)))
    del saved["model"]["rpe"]
    check_resume_compatible({"world_size": 1, "config": saved}, cfg, plan)
    cfg.model.rpe = True
    with pytest.raises(ConfigError, match="trained with model.rpe False, this run has True"):
        check_resume_compatible({"world_size": 1, "config": saved}, cfg, plan)


def test_resume_on_another_world_size_needs_the_same_global_batch():
    from train.config.ds_config import BatchPlan
    from train.config.errors import ConfigError
    from train.config.options import PretrainConfig
    from train.config.parsing import to_dict
    from train.run.build import check_resume_compatible

    cfg = PretrainConfig(ds_config="x.json")
    saved = json.loads(json.dumps(to_dict(cfg)))
    meta = {"world_size": 2, "global_batch": 16, "config": saved}
    check_resume_compatible(meta, cfg, BatchPlan(8, 2, 1))  # 8 x 2 x 1 = 16: allowed
    with pytest.raises(ConfigError, match="global batch 16 on 2 ranks, this run has 8 on 1"):
        check_resume_compatible(meta, cfg, BatchPlan(8, 1, 1))
    with pytest.raises(ConfigError, match="predates world-size changes"):
        check_resume_compatible({"world_size": 2, "config": saved}, cfg, BatchPlan(8, 2, 1))


def test_epoch_checkpoints_kept_for_later_evaluation(tmp_path):
    """run.keep_every_epochs: a checkpoint at every epoch end (8 steps here) that pruning spares,
    beside the newest run.keep_checkpoints regular ones; each exports like any other tag."""
    from train.weights.export import export_checkpoint

    run_pretrain(tmp_path, "--run.max_steps", "20", "--run.ckpt_every", "3", "--run.keep_checkpoints", "1",
                 "--run.keep_every_epochs", "1", "--run.log_every", "10")
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.glob("step*")) == ["step00000008", "step00000016", "step00000020"]
    assert [json.loads((root / t / "complete.json").read_text())["pinned"]
            for t in ("step00000008", "step00000016", "step00000020")] == [True, True, False]
    out = export_checkpoint(root / "step00000008", tmp_path / "epoch1" / "encoder.safetensors")
    assert out.is_file() and (tmp_path / "epoch1" / "encoder.json").is_file()


def strict_json(line: str):
    """json.loads refusing NaN and Infinity, which JSON does not have (JavaScript's JSON.parse fails on them)."""
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(line, parse_constant=refuse)


@pytest.fixture(scope="module")
def skipped_step(tmp_path_factory):
    """8 steps of 2 micro-batches whose step 3 has a NaN loss (the step is skipped), logged every 4
    steps and every step (the same training): {log_every: (run folder, process)}."""
    ds = tmp_path_factory.mktemp("ds") / "accum2.json"
    ds.write_text(json.dumps({**json.loads(CPU_DS.read_text()), "train_micro_batch_size_per_gpu": 4,
                              "gradient_accumulation_steps": 2}))
    runs = {}
    for log_every in (4, 1):
        out = tmp_path_factory.mktemp(f"log_every{log_every}")
        proc = run_pretrain(out, "--run.max_steps", "8", "--run.log_every", str(log_every), "--run.ckpt_every", "8",
                            ds_config=ds, faults="nan_loss@3")
        runs[log_every] = out, proc
    return runs


def test_a_skipped_step_leaves_its_windows_loss_the_mean_of_the_finite_ones(skipped_step):
    windows = [strict_json(line) for line in (skipped_step[4][0] / "metrics.jsonl").read_text().splitlines()]
    steps = [strict_json(line) for line in (skipped_step[1][0] / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in windows] == [4, 8] and [r["step"] for r in steps] == list(range(1, 9))
    assert steps[2]["loss"] is None and steps[2]["nonfinite_losses"] == 2  # no finite loss in step 3: null
    per_step = {r["step"]: r["loss"] for r in steps}
    assert windows[0]["loss"] == pytest.approx((per_step[1] + per_step[2] + per_step[4]) / 3, rel=1e-12)
    assert windows[0]["nonfinite_losses"] == 2 and windows[0]["skipped_steps"] == 1
    assert windows[1]["loss"] == pytest.approx(sum(per_step[s] for s in range(5, 9)) / 4, rel=1e-12)
    assert "nonfinite_losses" not in windows[1] and all("nonfinite_losses" not in r for r in steps if r["step"] != 3)


def test_the_run_ends_with_a_summary_line_that_agrees_with_metrics_jsonl(skipped_step):
    run_dir, proc = skipped_step[4]
    rows = read_metrics(run_dir)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("[pretrain] trained steps")]
    assert len(lines) == 1, proc.stderr[-3000:]
    seconds = sum(r["step_time"] * 4 for r in rows)  # the logged windows' training time
    assert re.fullmatch(rf"\[pretrain\] trained steps 1-8 in \d+\.\d s: loss {rows[-1]['loss']:.4g} \(last window\), "
                        rf"{8 * 8 / seconds:.0f} images/s over the run, 1 skipped step\(s\)", lines[0]), lines[0]
    assert proc.stderr.index(lines[0]) < proc.stderr.index("exported encoder to")
