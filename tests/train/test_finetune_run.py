"""train/finetune.py end to end: from an exported MAE encoder, RandAug + mixup + layer decay,
evaluation, exact resume, and a timm export that includes the classifier."""
import json
import subprocess
import sys

import pytest
import torch
from conftest import REPO, run_pretrain

from data.write_shards import main as write_shards
from model.objectives import build_objective
from model.objectives.finetune import FinetuneConfig
from model.registry import create_model
from train.engine.state_files import read_tensors
from train.run.folder import read_metrics
from train.weights.export import load_timm_encoder


def _finetune(out, *args):
    cmd = [sys.executable, str(REPO / "train" / "finetune.py"), "--ds_config", str(REPO / "ds_configs" / "cpu_debug.json"),
           "--output_dir", str(out), "--run.progress", "false", *args]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    import numpy as np
    from PIL import Image

    root = tmp_path_factory.mktemp("folder")
    for c in range(3):
        (root / f"c{c}").mkdir()
        for i in range(8):
            Image.fromarray(np.full((20, 20), 40 * c + 3 * i, dtype=np.uint8), mode="L").save(root / f"c{c}" / f"{i}.png")
    shards = tmp_path_factory.mktemp("shards")
    for name in ("train", "test"):  # the same images; the evaluation may not score the training shards
        write_shards(["imagefolder", str(root), str(shards), "--samples_per_shard", "3", "--name", name])
    index = shards / "train.json"
    common = ["--data.source", "shards", "--data.train_index", str(index), "--data.num_workers", "1",
              "--data.epoch_size", "0", "--model.in_chans", "3"]
    mae = tmp_path_factory.mktemp("mae")
    run_pretrain(mae, *common, "--run.max_steps", "2")
    args = [*common, "--model.name", "vit_debug_patch4", "--model.init_from", str(mae / "encoder.safetensors"),
            "--finetune.num_classes", "3", "--data.eval_index", str(shards / "test.json"), "--data.eval_crop_pct", "1.0",
            "--optim.epochs", "2", "--optim.warmup_epochs", "1", "--run.log_every", "1", "--run.ckpt_every", "3"]
    straight = tmp_path_factory.mktemp("ft")
    _finetune(straight, *args)
    return args, straight


def test_recipe_and_metrics(setup):
    _, run = setup
    config = json.loads((run / "config.json").read_text())
    assert config["optim"]["layer_decay"] == 0.65 and config["model"]["global_pool"] == "avg"
    assert config["data"]["train_transform"] == "randaug" and config["finetune"]["mixup"] == 0.8
    meta = json.loads((run / "meta.json").read_text())
    assert meta["param_split"]["layer_groups"] > 2
    rows = read_metrics(run)
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 7))
    [ev] = [r for r in rows if "eval_top1" in r]
    assert ev["eval_samples"] == 24 and 0 <= ev["eval_top1"] <= ev["eval_top5"] == 100.0  # 3 classes: top-5 = all


def test_resume_is_exact_with_mixup_randaug_and_drop_path(setup, tmp_path):
    args, straight = setup
    _finetune(tmp_path, *args, "--run.max_steps", "3")
    _finetune(tmp_path, *args, "--resume", "auto")
    want = {r["step"]: r["loss"] for r in read_metrics(straight) if "loss" in r}
    got = [r for r in read_metrics(tmp_path) if "loss" in r]
    assert [r["loss"] for r in got[3:]] == [want[s] for s in (4, 5, 6)]


def test_export_is_a_timm_classifier_with_the_same_logits(setup):
    _, run = setup
    timm_model = load_timm_encoder(run / "encoder.safetensors").eval()
    module = read_tensors(run / "checkpoints" / "step00000006")
    ours = build_objective("finetune", create_model("vit_debug_patch4", global_pool="avg"), FinetuneConfig(num_classes=3))
    ours.load_state_dict(module)
    x = torch.randn(2, 3, 28, 28)
    with torch.no_grad():
        assert torch.allclose(timm_model(x), ours.eval().predict(x), atol=1e-5)


def test_a_pretraining_run_folder_initialises_finetuning(setup, tmp_path):
    args, _ = setup
    mae_dir = args[args.index("--model.init_from") + 1].removesuffix("/encoder.safetensors")
    args = [a if a != args[args.index("--model.init_from") + 1] else mae_dir for a in args]
    proc = _finetune(tmp_path, *args, "--run.max_steps", "1")
    assert "initialised encoder (new: fc_norm.bias, fc_norm.weight, head.bias, head.weight)" in proc.stderr
    from safetensors.torch import load_file

    module = read_tensors(tmp_path / "checkpoints" / "step00000001")
    exported = load_file(mae_dir + "/encoder.safetensors")
    assert torch.equal(module["encoder.blocks.0.attn.qkv.weight"], exported["blocks.0.attn.qkv.weight"])  # lr 0 at step 1


def test_pos_embed_is_fine_tuned_and_the_timm_snippet_loads_the_classifier(setup):
    from safetensors.torch import load_file

    args, run = setup
    pretrained = load_file(args[args.index("--model.init_from") + 1])["pos_embed"]  # the fixed sin-cos table
    tuned = load_file(str(run / "encoder.safetensors"))["pos_embed"]
    assert tuned.shape == pretrained.shape and not torch.equal(tuned, pretrained)  # trained, as the recipe does
    info = json.loads((run / "encoder.json").read_text())
    scope: dict = {}
    exec(info["timm_snippet"], scope)  # noqa: S102 (the lines the export gives users)
    assert scope["model"].head.out_features == 3 and torch.equal(scope["model"].pos_embed.detach(), tuned)


def test_evaluate_reads_a_fine_tuned_encoder_with_the_features_its_classifier_saw(setup):
    """train.evaluate built every encoder with cls pooling and a final norm, so a fine-tuned one
    (avg pooling, fc_norm, a head) failed to load from its export and from its run; its avg
    features skipped fc_norm (off timm's pre-logits by up to 6.6 on these weights)."""
    from train.run.evaluation import load_encoder

    _, run = setup
    timm_model = load_timm_encoder(run / "encoder.safetensors").eval()
    x = torch.randn(2, 3, 28, 28)
    with torch.no_grad():
        want = timm_model.forward_head(timm_model.forward_features(x), pre_logits=True)
        for source in ({"encoder": str(run / "encoder.safetensors")}, {"checkpoint": str(run)}):
            model = load_encoder(**source).eval()
            assert model.global_pool == "avg" and isinstance(model.head, torch.nn.Identity)
            torch.testing.assert_close(model.pooled_features(x, "avg"), want, rtol=1e-5, atol=1e-5)
