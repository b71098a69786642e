import math
from pathlib import Path

import pytest
import torch

from data.shard_index import ShardSet
from data.write_shards import main as write_shards
from model import create_model
from train.run.evaluation import decode_all, evaluate, extract_features, knn_top1, linear_probe_top1, load_encoder


def test_knn_hand_computed():
    train_f = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0]])
    train_y = torch.tensor([0, 0, 1])
    test_f = torch.tensor([[0.2, 1.0], [1.0, 0.05]])
    # k=1: nearest by cosine -> classes 1 and 0
    assert knn_top1(train_f, train_y, test_f, torch.tensor([1, 0]), 2, k=1) == 100.0
    # k=3 with a tiny temperature: the single most similar neighbour dominates the weighted vote
    assert knn_top1(train_f, train_y, test_f, torch.tensor([1, 0]), 2, k=3, temperature=0.01) == 100.0
    # k=3 with a huge temperature: plain majority (two of class 0) wins for both
    assert knn_top1(train_f, train_y, test_f, torch.tensor([0, 0]), 2, k=3, temperature=1e6) == 100.0


def test_linear_probe_separates_separable_data_and_not_noise():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(400, 8, generator=g)
    y = (x[:, 0] + 0.5 * x[:, 3] > 0).long()
    assert linear_probe_top1(x[:300], y[:300], x[300:], y[300:], 2) > 90.0
    noise_y = torch.randint(0, 2, (400,), generator=g)
    assert linear_probe_top1(x[:300], noise_y[:300], x[300:], noise_y[300:], 2) < 70.0


def test_knn_is_cosine_whatever_each_training_features_norm():
    # by dot product a long training vector would be every sample's nearest: cosine ignores its length
    far = torch.tensor([[1.0, 0.0], [0.0, 10.0]])
    assert knn_top1(far, torch.tensor([0, 1]), torch.tensor([[1.0, 0.2]]), torch.tensor([0]), 2, k=1) == 100.0
    g = torch.Generator().manual_seed(0)
    train_f, test_f = torch.randn(60, 8, generator=g), torch.randn(40, 8, generator=g)
    train_y, test_y = torch.randint(0, 4, (60,), generator=g), torch.randint(0, 4, (40,), generator=g)
    scaled = train_f * torch.rand(60, 1, generator=g).mul(100).add(0.01)  # each row by its own positive factor
    unit = train_f / train_f.norm(dim=1, keepdim=True)
    assert knn_top1(scaled, train_y, test_f, test_y, 4, k=5) == knn_top1(unit, train_y, test_f, test_y, 4, k=5)


def test_knn_votes_with_exactly_k_neighbours():
    """The nearest training feature is of class 0, the next two (nearly as near) of class 1: with
    k=2 at T=1 the votes are exp(1) for class 0 against exp(cos 0.2) for class 1, class 0 wins; a
    third neighbour adds exp(cos 0.25) to class 1, which then wins."""
    train_f = torch.tensor([[1.0, 0.0], [math.cos(0.2), math.sin(0.2)], [math.cos(0.25), math.sin(0.25)]])
    train_y, test_f, test_y = torch.tensor([0, 1, 1]), torch.tensor([[1.0, 0.0]]), torch.tensor([0])
    assert math.exp(1.0) > math.exp(math.cos(0.2))  # k=2: class 0
    assert math.exp(math.cos(0.2)) + math.exp(math.cos(0.25)) > math.exp(1.0)  # k=3: class 1
    assert knn_top1(train_f, train_y, test_f, test_y, 2, k=2, temperature=1.0) == 100.0
    assert knn_top1(train_f, train_y, test_f, test_y, 2, k=3, temperature=1.0) == 0.0


def test_knn_is_cosine_whatever_each_test_features_norm():
    """Cosine similarities ignore the test features' length: scaled down 100 times (by dot product
    every vote would then weigh about the same, and the two class-1 neighbours would outvote the
    nearest one, of class 0) the result is the same."""
    train_f = torch.tensor([[1.0, 0.0], [0.6, 0.8], [0.6, -0.8]])
    train_y, test_f, test_y = torch.tensor([0, 1, 1]), torch.tensor([[1.0, 0.0]]), torch.tensor([0])
    assert knn_top1(train_f, train_y, test_f, test_y, 2, k=3) == 100.0  # exp(1 / 0.07) > 2 exp(0.6 / 0.07)
    assert knn_top1(train_f, train_y, test_f * 0.01, test_y, 2, k=3) == 100.0
    g = torch.Generator().manual_seed(0)
    train_f, test_f = torch.randn(60, 8, generator=g), torch.randn(40, 8, generator=g)
    train_y, test_y = torch.randint(0, 4, (60,), generator=g), torch.randint(0, 4, (40,), generator=g)
    scaled = test_f * torch.rand(40, 1, generator=g).mul(100).add(0.001)  # each row by its own positive factor
    assert knn_top1(train_f, train_y, scaled, test_y, 4, k=5) == knn_top1(train_f, train_y, test_f, test_y, 4, k=5)


def test_knn_scores_each_chunk_against_its_own_labels():
    # the training set scored on itself with k=1: each sample is its own nearest, 100% whatever the chunk
    g = torch.Generator().manual_seed(0)
    f, y = torch.randn(10, 8, generator=g), torch.arange(10) % 5  # labels differ from chunk to chunk
    assert knn_top1(f, y, f, y, 5, k=1, chunk=3) == 100.0
    test_f, test_y = torch.randn(25, 8, generator=g), torch.randint(0, 5, (25,), generator=g)
    assert knn_top1(f, y, test_f, test_y, 5, k=3, chunk=4) == knn_top1(f, y, test_f, test_y, 5, k=3, chunk=1024)


def test_linear_probe_standardises_each_feature_by_its_own_std():
    """The informative feature on a scale a thousand times below the others: standardised per
    feature it weighs as much as they do (one std for all would leave it ~0)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(400, 8, generator=g)
    y = (x[:, 0] > 0).long()
    x[:, 1:] *= 1000.0
    assert linear_probe_top1(x[:300], y[:300], x[300:], y[300:], 2) > 90.0


def test_linear_probe_weight_decay_pulls_the_head_to_the_class_prior():
    """Separable data, 3 to 1 imbalanced: with an overwhelming weight decay on the weights (not the
    bias) the head predicts the training majority class for every sample."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(400, 8, generator=g)
    y = (x[:, 0] > -0.6745).long()  # the standard normal's lower quartile: ~3/4 class 1
    majority = int(y[:300].bincount().argmax())
    assert linear_probe_top1(x[:300], y[:300], x[300:], y[300:], 2, weight_decay=1e-4) > 90.0
    assert linear_probe_top1(x[:300], y[:300], x[300:], y[300:], 2, weight_decay=1e3) == pytest.approx(
        100.0 * (y[300:] == majority).float().mean().item())


@pytest.fixture
def shards(image_folder, tmp_path):
    """s/train.json; beside it s/test.json, the same images in shards of their own: a held-out index
    for train.evaluate (which refuses to score the training shards)."""
    for name in ("train", "test"):
        write_shards(["imagefolder", str(image_folder), str(tmp_path / "s"), "--samples_per_shard", "5", "--name", name])
    return ShardSet.from_index(tmp_path / "s" / "train.json")


@pytest.mark.parametrize("workers", [0, 2])
def test_features_cover_every_sample_once(shards, workers):
    model = create_model("vit_debug_patch4")
    f, y, coverage = extract_features(model, shards, batch_size=7, num_workers=workers)
    assert f.shape == (24, 32) and sorted(y.tolist()) == sorted([0] * 8 + [1] * 8 + [2] * 8)
    assert coverage == (shards.index, 24, 24, {})
    f2, y2, _ = extract_features(model, shards, batch_size=7, num_workers=workers, pool="avg")
    assert f2.shape == (24, 32) and not torch.allclose(f, f2)


def test_decoded_once_gives_the_features_and_scores_of_reading_the_shards(shards):
    model = create_model("vit_debug_patch4")
    decoded = decode_all(shards, model.img_size, num_workers=0)
    assert decoded.images.shape == (24, 3, model.img_size, model.img_size) and decoded.classes == shards.classes
    f, y, _ = extract_features(model, shards, batch_size=7, num_workers=0)
    f2, y2, _ = extract_features(model, decoded, batch_size=5)
    assert torch.equal(y, y2) and torch.allclose(f, f2, atol=1e-6)
    assert evaluate(model, decoded, decoded) == pytest.approx(evaluate(model, shards, shards, num_workers=0))
    with pytest.raises(ValueError, match="decoded at 28 px"):
        extract_features(create_model("vit_debug_patch4", img_size=16), decoded)


def test_random_init_control_is_reproducible_and_sources_exclusive():
    a, b = load_encoder(random_init="vit_debug_patch4", seed=3), load_encoder(random_init="vit_debug_patch4", seed=3)
    assert torch.equal(a.blocks[0].attn.qkv.weight, b.blocks[0].attn.qkv.weight)
    with pytest.raises(ValueError, match="exactly one"):
        load_encoder(encoder="x.safetensors", random_init="vit_debug_patch4")


@pytest.mark.parametrize("layout", ["official MAE .pth", "timm .safetensors"])
def test_an_official_or_timm_encoder_is_evaluated_at_the_size_asked(tmp_path, layout):
    """--img_size holds for every source: an official MAE / timm state (no .json beside it) is
    rebuilt at that size with its position table resized, as exported encoders are."""
    from safetensors.torch import save_file

    from model.interop import resize_pos_embed

    torch.manual_seed(0)
    trained = create_model("vit_small_patch16", img_size=32)  # a 2 x 2 grid (a width whose heads the state implies)
    state = {k: v.detach().clone().contiguous() for k, v in trained.state_dict().items()}
    path = tmp_path / ("mae.pth" if layout.startswith("official") else "timm.safetensors")
    torch.save({"model": state}, path) if path.suffix == ".pth" else save_file(state, str(path))
    same = load_encoder(encoder=str(path))
    assert same.img_size == 32 and torch.equal(same.pos_embed, trained.pos_embed)
    larger = load_encoder(encoder=str(path), img_size=64)  # a 4 x 4 grid
    assert larger.img_size == 64 and larger.pos_embed.shape == (1, 17, trained.embed_dim)
    assert torch.equal(larger.pos_embed, resize_pos_embed(trained.pos_embed, (4, 4)))
    assert torch.equal(larger.blocks[0].attn.qkv.weight, trained.blocks[0].attn.qkv.weight)


def test_features_skip_a_truncated_shard(shards):
    first = shards.files[0]
    first.write_bytes(first.read_bytes()[:700])  # cut inside the first sample
    f, y, coverage = extract_features(create_model("vit_debug_patch4"), shards, batch_size=7, num_workers=0)
    assert 19 <= len(f) < 24 and len(f) == len(y)  # the other shards are read in full
    assert coverage.used == len(f) and coverage.skipped == {"truncated_shard": 24 - len(f)}  # what it did not deliver


@pytest.mark.parametrize("workers", [0, 2])
def test_subsample_is_seeded_and_decodes_only_the_chosen_samples(shards, workers):
    from train.run.evaluation import subsample

    model = create_model("vit_debug_patch4")
    full_f = extract_features(model, shards, batch_size=7, num_workers=0).features
    sub = subsample(shards, 10, seed=3)
    assert sub.num_samples == 10 and sub.classes == shards.classes
    f, y, coverage = extract_features(model, sub, batch_size=4, num_workers=workers)
    assert coverage.listed == coverage.used == 10
    assert f.shape == (10, 32) and len(y) == 10
    # every feature is one of the full set's, each a different sample
    match = torch.cdist(f, full_f).argmin(1)
    assert torch.allclose(f, full_f[match], atol=1e-6) and len(set(match.tolist())) == 10
    f2 = extract_features(model, subsample(shards, 10, seed=3), batch_size=4, num_workers=0).features
    # the same subset for the same seed, whatever the workers (which interleave the order)
    assert set(torch.cdist(f2, full_f).argmin(1).tolist()) == set(match.tolist())
    other = set(torch.cdist(extract_features(model, subsample(shards, 10, seed=4), num_workers=0)[0],
                            full_f).argmin(1).tolist())
    assert other != set(match.tolist())  # another seed, other samples
    assert subsample(shards, 0, seed=3) is shards and subsample(shards, 24, seed=3) is shards


def test_evaluate_command_caps_train_and_test_samples(shards, tmp_path):
    from train.evaluate import main

    index = str(tmp_path / "s" / "train.json")

    held_out = str(tmp_path / "s" / "test.json")
    result = main(["--train_index", index, "--test_index", held_out, "--random_init", "vit_debug_patch4",
                   "--num_workers", "0", "--max_train", "12", "--max_test", "5", "--out", str(tmp_path / "e.json")])
    assert result["train_samples"] == 12 and result["test_samples"] == 5
    assert 0.0 <= result["knn_top1"] <= 100.0 and result["knn_top1"] * 5 / 100 == pytest.approx(
        round(result["knn_top1"] * 5 / 100))  # a share of 5 test samples
    with pytest.raises(SystemExit):
        main(["--train_index", index, "--test_index", held_out, "--random_init", "vit_debug_patch4", "--max_test", "-1"])


def test_a_checkpoint_of_a_width_without_known_heads_is_evaluated_with_num_heads(shards, tmp_path):
    """A 256-wide ViT's weights do not say its heads: the refusal names --num_heads (it named an
    option evaluate did not have), and with it the encoder computes what was trained."""
    from model.vit import VisionTransformer
    from train.config.errors import ConfigError
    from train.evaluate import main

    torch.manual_seed(0)
    trained = VisionTransformer(img_size=32, patch_size=8, embed_dim=256, depth=2, num_heads=4).eval()
    path = tmp_path / "w256.pth"
    torch.save(trained.state_dict(), path)
    index = str(tmp_path / "s" / "train.json")
    held_out = str(tmp_path / "s" / "test.json")
    argv = ["--train_index", index, "--test_index", held_out, "--encoder", str(path), "--num_workers", "0"]
    for extra, says in (([], r"cannot infer the number of heads of a 256-wide ViT .*pass num_heads \(train.evaluate: "
                                 r"--num_heads\)"),
                        (["--num_heads", "3"], "3 heads do not divide the width 256"),
                        (["--num_heads", "-1"], "--num_heads must be >= 0")):
        with pytest.raises(ConfigError, match=says):
            main(argv + extra)
    with pytest.raises(ConfigError, match="--num_heads is for an official MAE or timm checkpoint"):
        main(["--train_index", index, "--test_index", held_out, "--random_init", "vit_debug_patch4", "--num_heads", "2"])
    loaded = load_encoder(encoder=str(path), num_heads=4).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(loaded.forward_features(x), trained.forward_features(x))
    assert main(argv + ["--num_heads", "4"])["test_samples"] == 24


def test_evaluate_num_workers_is_trainings_auto_and_no_more_than_the_shards_feed(shards, tmp_path):
    """-1 is data.num_workers' auto; a count beyond the shards (each worker reads whole shards) is
    refused before any worker starts, naming the count that fits."""
    from train.config.errors import ConfigError
    from train.evaluate import main

    index = str(tmp_path / "s" / "train.json")  # 24 samples in 5 shards

    held_out = str(tmp_path / "s" / "test.json")
    argv = ["--train_index", index, "--test_index", held_out, "--random_init", "vit_debug_patch4"]
    assert main(argv + ["--num_workers", "-1"])["test_samples"] == 24
    with pytest.raises(ConfigError, match=r"5 shards cannot feed 1000 workers: .*--num_workers 5, or -1 for auto"):
        main(argv + ["--num_workers", "1000"])
    with pytest.raises(ConfigError, match="--num_workers must be >= 0, or -1 for auto, got -2"):
        main(argv + ["--num_workers", "-2"])


@pytest.mark.parametrize("option", ["--seed", "--subset_seed"])
def test_evaluate_seeds_lie_in_trainings_range(shards, tmp_path, capsys, option):
    """Seeds take training's range [0, 2**31 - 1]; outside it one line and exit 2, never a traceback."""
    from train.evaluate import main

    index = str(tmp_path / "s" / "train.json")

    held_out = str(tmp_path / "s" / "test.json")
    argv = ["--train_index", index, "--test_index", held_out, "--random_init", "vit_debug_patch4", "--num_workers", "0",
            "--max_train", "5"]
    for value in ("-1", "2147483648", "18446744073709551617"):
        with pytest.raises(SystemExit) as stopped:
            main(argv + [option, value])
        err = capsys.readouterr().err
        assert stopped.value.code == 2 and err.count("\n") == 1
        assert f"argument {option}: must be in [0, 2147483647], got {value}" in err
    assert main(argv + [option, "2147483647"])["train_samples"] == 5


def test_evaluate_refuses_an_img_size_whose_batch_cannot_fit_before_building_the_encoder(shards, tmp_path, monkeypatch):
    import train.evaluate
    from train.config.errors import ConfigError
    from train.evaluate import main

    index = str(tmp_path / "s" / "train.json")

    held_out = str(tmp_path / "s" / "test.json")
    argv = ["--train_index", index, "--test_index", held_out, "--random_init", "vit_debug_patch4", "--num_workers", "0"]
    built = []
    monkeypatch.setattr(train.evaluate, "load_encoder", lambda *a: built.append(a))
    with pytest.raises(ConfigError, match=r"--img_size 100000: one batch of 24 images of 3 x 100000 x 100000 float32 "
                                          r"needs 2,682.2 GiB, more than the .* GiB of this machine's memory; give a "
                                          r"smaller --img_size"):
        main(argv + ["--img_size", "100000"])
    assert built == []

    def out_of_memory(*a):  # what torch raises when the position table at that size cannot be allocated
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
                           "memory: you tried to allocate 40000000000 bytes. Error code 12 (Cannot allocate memory)")

    monkeypatch.setattr(train.evaluate, "load_encoder", out_of_memory)
    with pytest.raises(ConfigError, match=r"can't allocate memory.*\(--img_size 64: the encoder at that size does not "
                                          r"fit in memory; give a smaller size, or 0 for its own\)"):
        main(argv + ["--img_size", "64"])


FIX = r"give the .json train.export wrote beside these weights"


@pytest.mark.parametrize("edit, says", [
    (lambda d: d | {"timm_kwargs": [1, 2]}, r"debug.json: timm_kwargs is \[1, 2\], not a table of the encoder's "
                                            r"architecture \(img_size, .*\): " + FIX),
    (lambda d: {"model_name": "vit_debug_patch4"}, r"description .*debug.json holds no timm_kwargs .*: " + FIX),
    (lambda d: [d], r"description .*debug.json holds no timm_kwargs"),
    (lambda d: d | {"timm_kwargs": d["timm_kwargs"] | {"depth": "2"}},
     r"debug.json: timm_kwargs: depth is '2', not an integer >= 1: " + FIX),
    (lambda d: d | {"timm_kwargs": d["timm_kwargs"] | {"embed_dim": True}}, r"embed_dim is True, not an integer >= 1"),
    (lambda d: d | {"timm_kwargs": d["timm_kwargs"] | {"mlp_ratio": float("nan")}},
     r"mlp_ratio is nan, not a finite number > 0"),
    (lambda d: d | {"timm_kwargs": {k: v for k, v in d["timm_kwargs"].items() if k != "num_heads"}},
     r"debug.json: timm_kwargs has no num_heads: " + FIX),
    (lambda d: d | {"timm_kwargs": d["timm_kwargs"] | {"depth": 10**7}},
     r"debug.json: timm_kwargs does not describe the weights beside it, which hold 2 blocks, where the model has "
     r"10000000: " + FIX),
    (lambda d: d | {"timm_kwargs": d["timm_kwargs"] | {"embed_dim": 2**20, "num_heads": 1}},
     r"which hold blocks.0.attn.proj.bias of shape \[32\] \(the model's: \[1048576\]\)"),
], ids=["a list", "no timm_kwargs", "not an object", "a depth in quotes", "a width true", "a NaN MLP ratio",
        "no heads", "a depth the weights do not hold", "a width the weights do not have"])
def test_an_exported_encoder_is_built_only_as_its_description_says_and_its_weights_hold(tmp_path, edit, says):
    """The .json beside an export sets the encoder's sizes: each is checked for its type, and the
    whole against the weights' names and shapes (on the meta device), before anything is built."""
    import json

    from safetensors.torch import save_file

    encoder = create_model("vit_debug_patch4")
    save_file({k: v.contiguous() for k, v in encoder.state_dict().items()}, str(tmp_path / "debug.safetensors"))
    description = {"timm_kwargs": encoder.timm_kwargs(), "model_name": "vit_debug_patch4"}
    (tmp_path / "debug.json").write_text(json.dumps(description))
    assert load_encoder(encoder=str(tmp_path / "debug.safetensors")).arch == encoder.arch
    (tmp_path / "debug.json").write_text(json.dumps(edit(description)))
    with pytest.raises(ValueError, match=says):
        load_encoder(encoder=str(tmp_path / "debug.safetensors"))


def test_a_checkpoint_whose_meta_claims_another_encoder_is_refused_before_building_it(tmp_path, monkeypatch):
    """complete.json's encoder_timm_kwargs are judged as an export's .json is."""
    from train.engine import checkpoint
    from train.weights import export

    encoder = create_model("vit_debug_patch4")
    meta = {"encoder_timm_kwargs": encoder.timm_kwargs() | {"depth": 10**7}}
    tag = tmp_path / "run" / "checkpoints" / "step00000004"
    monkeypatch.setattr(checkpoint, "find_resume", lambda given, path: tag)
    monkeypatch.setattr(export, "encoder_state", lambda found: (encoder.state_dict(), meta))
    with pytest.raises(ValueError, match=r"step00000004/complete.json: encoder_timm_kwargs does not describe the "
                                         r"weights beside it, which hold 2 blocks, where the model has 10000000: give "
                                         r"another of the run's checkpoints"):
        load_encoder(checkpoint=str(tmp_path / "run"))
    meta.clear()
    with pytest.raises(ValueError, match=r"complete.json holds no encoder_timm_kwargs"):
        load_encoder(checkpoint=str(tmp_path / "run"))
    meta["encoder_timm_kwargs"] = encoder.timm_kwargs()
    assert torch.equal(load_encoder(checkpoint=str(tmp_path / "run")).pos_embed, encoder.pos_embed)


def test_a_subset_of_an_index_claiming_a_trillion_samples_draws_only_the_subset():
    """An index's counts are a claim: the subset is drawn without a permutation of all of them
    (8 TB for 10**12), and below LARGEST_PERMUTATION it is the permutation's, as it always was."""
    from train.run.evaluation import subsample

    claimed = ShardSet(files=(Path("a.tar"), Path("b.tar")), counts=(10**12, 12), classes=("a",))
    sub = subsample(claimed, 10, seed=0)
    assert sub.num_samples == 10 and subsample(claimed, 10, seed=0) == sub
    assert all(0 <= p < 10**12 for keep in sub.keep for p in keep) and subsample(claimed, 10, seed=1) != sub
    small = ShardSet(files=(Path("a.tar"), Path("b.tar")), counts=(30, 12), classes=("a",))
    sub = subsample(small, 7, seed=5)
    start = {Path("a.tar"): 0, Path("b.tar"): 30}
    chosen = sorted(start[f] + p for f, keep in zip(sub.files, sub.keep, strict=True) for p in keep)
    assert chosen == sorted(torch.randperm(42, generator=torch.Generator().manual_seed(5))[:7].tolist())


def _shard_set(name, shards):
    return ShardSet(files=tuple(Path(f"{name}-{i:06d}.tar") for i in range(shards)), counts=(10,) * shards,
                    classes=("a",))


def test_evaluate_workers_are_capped_by_the_larger_splits_shards():
    """Each worker reads whole shards of one split at a time: the split with more shards sets how many
    workers can be fed; as many workers as shards is fine."""
    from train.config.errors import ConfigError
    from train.evaluate import checked_workers

    assert checked_workers(1, _shard_set("train", 1), _shard_set("test", 1)) == 1  # the default, one shard each
    assert checked_workers(2, _shard_set("train", 5), _shard_set("test", 1)) == 2  # train's 5 shards feed 2
    assert checked_workers(5, _shard_set("train", 5), _shard_set("test", 1)) == 5
    with pytest.raises(ConfigError, match="5 shards cannot feed 6 workers"):
        checked_workers(6, _shard_set("train", 1), _shard_set("test", 5))
