"""train/export.py: a pretraining checkpoint -> timm safetensors that rebuilds the same encoder."""
import json

import pytest
import torch
from conftest import run_pretrain
from safetensors.torch import load_file

from model import create_model
from train.engine.state_files import read_tensors
from train.export import main as export_main
from train.weights.export import load_timm_encoder


def _our_encoder_from_checkpoint(tag_dir):
    module = read_tensors(tag_dir)
    enc = create_model("vit_debug_patch4", in_chans=1)
    enc.load_state_dict({k[len("encoder."):]: v.float() for k, v in module.items() if k.startswith("encoder.")})
    return enc.eval()


@pytest.fixture(scope="module")
def fp32_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("fp32")
    run_pretrain(out, "--run.max_steps", "2")
    return out


def test_export_loads_strictly_into_timm_with_same_features(fp32_run, tmp_path):
    path = export_main(["--checkpoint", str(fp32_run), "--out", str(tmp_path / "enc.safetensors")])
    info = json.loads(path.with_suffix(".json").read_text())
    assert info["step"] == 2 and info["timm_kwargs"]["in_chans"] == 1
    timm_model = load_timm_encoder(path).eval()  # strict=True inside
    ours = _our_encoder_from_checkpoint(fp32_run / "checkpoints" / "step00000002")
    x = torch.randn(4, 1, 28, 28)
    with torch.no_grad():
        assert torch.allclose(timm_model.forward_features(x), ours.forward_features(x), atol=1e-5)
    # the copy written by the run itself is the same export
    assert torch.equal(load_file(str(fp32_run / "encoder.safetensors"))["norm.weight"], load_file(str(path))["norm.weight"])
    assert not any(k.startswith(("decoder", "mask_token")) for k in load_file(str(path)))


def test_bf16_run_exports_fp32_master_weights(tmp_path):
    ds = tmp_path / "bf16.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
                              "gradient_clipping": 0.0, "zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}))
    run_pretrain(tmp_path / "run", "--run.max_steps", "2", ds_config=ds)
    exported = load_file(str(tmp_path / "run" / "encoder.safetensors"))
    module = read_tensors(tmp_path / "run" / "checkpoints" / "step00000002")
    w = exported["blocks.0.attn.qkv.weight"]
    assert w.dtype == torch.float32 and torch.equal(module["encoder.blocks.0.attn.qkv.weight"], w)  # the checkpoint's
    assert not torch.equal(w, w.bfloat16().float())  # real fp32 masters, not the rounded bf16 copy
    # frozen tables (the sin-cos pos_embed) are held in bf16 as the module holds them: exported as fp32 too
    assert module["encoder.pos_embed"].dtype == torch.bfloat16
    assert {t.dtype for t in exported.values()} == {torch.float32}
    assert torch.equal(exported["pos_embed"], module["encoder.pos_embed"].float())
    load_timm_encoder(tmp_path / "run" / "encoder.safetensors")
    from train.engine.checkpoint import verify_safe

    verify_safe(tmp_path / "run" / "checkpoints" / "step00000002")  # every file of the tag passes the scan


def test_evaluation_loads_the_exported_encoder_and_the_checkpoint_alike(fp32_run):
    from train.run.evaluation import load_encoder

    from_export = load_encoder(encoder=str(fp32_run / "encoder.safetensors")).eval()
    from_ckpt = load_encoder(checkpoint=str(fp32_run)).eval()
    x = torch.randn(2, 1, 28, 28)
    with torch.no_grad():
        assert torch.equal(from_export.forward_features(x), from_ckpt.forward_features(x))


def _run_snippet(snippet: str) -> torch.nn.Module:
    """The lines encoder.json / the export command give users, run as they are."""
    scope: dict = {}
    exec(snippet, scope)  # noqa: S102 (our own generated text)
    return scope["model"].eval()


def test_the_written_timm_snippet_loads_strictly_with_the_same_features(fp32_run):
    info = json.loads((fp32_run / "encoder.json").read_text())
    model = _run_snippet(info["timm_snippet"])
    ours = _our_encoder_from_checkpoint(fp32_run / "checkpoints" / "step00000002")
    x = torch.randn(2, 1, 28, 28)
    with torch.no_grad():
        assert torch.allclose(model.forward_features(x), ours.forward_features(x), atol=1e-5)


@pytest.mark.parametrize("name,overrides,head", [
    ("vit_tiny_patch16", {}, 0),  # pretrained encoder at 224: timm's own name
    ("vit_tiny_patch16", {"global_pool": "avg", "in_chans": 1}, 10),  # a fine-tuned classifier
    ("vit_tiny_patch16", {"img_size": 112}, 0),  # timm's name is of its 224 px model: VisionTransformer(**kwargs)
    ("vit_debug_patch4", {"img_size": 32}, 0),  # no timm name: VisionTransformer(**kwargs)
    ("timm/convnext_atto", {"img_size": 32}, 0),  # timm backbones: no img_size argument ...
    ("timm/vit_tiny_patch16_224", {"img_size": 32}, 0),  # ... or one
])
def test_timm_snippet_for_each_kind_of_encoder(tmp_path, name, overrides, head):
    import timm
    from safetensors.torch import save_file

    from train.weights.export import timm_loading

    torch.manual_seed(0)
    enc = create_model(name, **overrides)
    if head:
        enc.reset_head(head)
    enc.eval()
    path = tmp_path / "encoder.safetensors"
    state = {k: v.contiguous() for k, v in enc.state_dict().items()}
    save_file(state, str(path))
    info = timm_loading(enc.timm_kwargs(), name, state, path)
    assert "num_classes=" in info["timm_snippet"] and "timm_kwargs" not in info["timm_snippet"]
    if not name.startswith("timm/") and enc.img_size != 224:  # timm's named ViTs are 224 px: ours at another
        assert info["timm_model_name"] is None  # size are built from their own arguments
        assert f"VisionTransformer(img_size={enc.img_size}, " in info["timm_snippet"]
    model = _run_snippet(info["timm_snippet"])  # load_state_dict(strict=True) inside
    x = torch.randn(2, overrides.get("in_chans", 3), enc.img_size, enc.img_size)
    with torch.no_grad():
        assert torch.allclose(model(x), enc(x), atol=1e-5)
    if info["timm_model_name"] and not head:  # why the snippet passes num_classes=0: timm's default adds a head
        with pytest.raises(RuntimeError, match="head"):
            kw = {k: v for k, v in info["timm_create_kwargs"].items() if k != "num_classes"}
            timm.create_model(info["timm_model_name"], **kw).load_state_dict(load_file(str(path)))


def test_an_irpe_encoder_gets_no_timm_snippet(tmp_path):
    from train.weights.export import timm_loading

    enc = create_model("vit_debug_patch4", rpe=True)
    assert timm_loading(enc.timm_kwargs(), "vit_debug_patch4", enc.state_dict(), tmp_path / "e.safetensors") == {
        "timm_model_name": None, "timm_create_kwargs": None, "timm_snippet": None}


@pytest.mark.parametrize("fmt", ["timm", "transformers"])
def test_a_checkpoint_whose_description_claims_another_encoder_is_not_built(fp32_run, tmp_path, fmt, capsys):
    """complete.json's encoder_timm_kwargs are judged against the weights before an exporter builds
    a model of their sizes (a depth of ten million ran out of memory in timm's or transformers' build)."""
    import shutil

    from train.run.cli import cli

    run = tmp_path / "run"
    shutil.copytree(fp32_run, run)
    [tag] = sorted((run / "checkpoints").glob("step*"))
    meta = json.loads((tag / "complete.json").read_text())
    meta["encoder_timm_kwargs"]["depth"] = 10**7
    (tag / "complete.json").write_text(json.dumps(meta))
    out = tmp_path / ("out.safetensors" if fmt == "timm" else "out")
    with pytest.raises(SystemExit) as stopped:
        cli(lambda: export_main(["--checkpoint", str(run), "--format", fmt, "--out", str(out)]))
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.count("\n") == 1, err
    assert "complete.json: encoder_timm_kwargs does not describe the weights beside it, which hold 2 blocks, " \
           "where the model has 10000000" in err
    assert not out.exists()


def _run_copy(fp32_run, tmp_path):
    """A copy of the 2-step run (its one tag step00000002 and its own export, encoder.*)."""
    import shutil

    shutil.copytree(fp32_run, tmp_path / "run")
    return tmp_path / "run"


def _exported(run):
    return {name: (run / name).read_bytes() for name in ("encoder.safetensors", "encoder.json")}


def test_a_tags_export_is_named_after_it_and_leaves_the_runs_own_export(fp32_run, tmp_path, capsys):
    """--checkpoint <run>/checkpoints/<tag> without --out writes <run>/encoder_<tag>.safetensors +
    .json: the run's encoder.safetensors (its final export, what evaluations read) stays as it was."""
    run = _run_copy(fp32_run, tmp_path)
    own = _exported(run)
    tag = run / "checkpoints" / "step00000002"
    path = export_main(["--checkpoint", str(tag)])
    assert path == run / "encoder_step00000002.safetensors"
    assert json.loads(path.with_suffix(".json").read_text())["step"] == 2
    assert _exported(run) == own
    assert f"wrote {path} and {path.with_suffix('.json')} from {tag}" in capsys.readouterr().out
    assert export_main(["--checkpoint", str(tag)]) == path  # the same step's export: replaced unasked
    assert export_main(["--checkpoint", str(run)]) == run / "encoder.safetensors"  # a run folder: the run's own


@pytest.mark.parametrize("default, described", [("encoder.json", {"step": 1}),
                                                ("encoder_step00000002.json", {"source": "elsewhere"})],
                         ids=["another step", "no step recorded"])
def test_a_default_output_of_another_step_is_replaced_only_with_overwrite(fp32_run, tmp_path, capsys, default,
                                                                         described):
    """A default output that holds the export of another step (or says none) is someone's result:
    refused in one line naming both steps and the fix, nothing written; --overwrite replaces it."""
    from train.run.cli import cli

    run = _run_copy(fp32_run, tmp_path)
    (run / default).write_text(json.dumps(described))
    weights = run / default.replace(".json", ".safetensors")
    weights.write_bytes(b"an earlier export")
    argv = ["--checkpoint", str(run if default == "encoder.json" else run / "checkpoints" / "step00000002")]
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    with pytest.raises(SystemExit) as stopped:
        cli(lambda: export_main(argv))
    err = capsys.readouterr().err
    held = "the export of step 1" if "step" in described else "an export of no recorded step"
    assert stopped.value.code == 2 and err.count("\n") == 1, err
    assert f"{weights} holds {held}, not of the checkpoint {run / 'checkpoints' / 'step00000002'} (step 2): pass " \
           f"--overwrite to replace it, or give --out another path" in err
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before
    assert export_main([*argv, "--overwrite"]) == weights
    assert json.loads((run / default).read_text())["step"] == 2


def test_an_empty_transformers_folder_is_no_earlier_export_and_is_written_into_without_overwrite(tmp_path):
    """An empty transformers_<tag>/ (made by hand, or by mkdir -p) holds nobody's result: the export
    goes ahead unasked, while the same folder holding files of no recorded step is refused."""
    from train.config.errors import ConfigError
    from train.export import check_same_step

    tag = tmp_path / "checkpoints" / "step00000010"
    tag.mkdir(parents=True)
    (tag / "complete.json").write_text(json.dumps({"step": 10}))
    out = tmp_path / "transformers_step00000010"
    out.mkdir()
    check_same_step(out, tag, folder=True)
    (out / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="an export of no recorded step"):
        check_same_step(out, tag, folder=True)
