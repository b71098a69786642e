"""Labels only where they are used: what reads labels (fine-tuning, the linear probe,
MLO-MAE's labeled split, the evaluation on data.eval_index) refuses an unlabeled shard index
before start, with exit status 2 and a message naming the index and the fix; a labeled index is
read only under the label key it was indexed with."""
import pytest
import torch
from conftest import CPU_DS, DEBUG_PRESET
from wds_shards import write_img2dataset_shards, write_index

from train import finetune, linprobe, pretrain
from train.config.errors import ConfigError
from train.config.parsing import parse_args
from train.run.cli import cli

CONFIGS = DEBUG_PRESET.parent.parent


@pytest.fixture(scope="module")
def indexes(tmp_path_factory):
    root = tmp_path_factory.mktemp("byod")
    plain = write_img2dataset_shards(root / "unlabeled")
    labeled = write_img2dataset_shards(root / "labeled", label_field="label")
    return {"unlabeled": write_index(root / "unlabeled" / "train.json", plain, [8, 8]),
            "labeled": write_index(root / "labeled" / "train.json", labeled, [8, 8], labeled=True,
                                   label_key="json:label", classes=["0", "1", "2"])}


def refused(tmp_path, capsys, entry, *args) -> str:
    """`entry` (an entry point's main) exits 2 before the process group and the run folder."""
    out = tmp_path / "run"
    argv = ["--ds_config", str(CPU_DS), "--config", str(DEBUG_PRESET), "--output_dir", str(out), "--run.progress",
            "false", "--data.source", "shards", "--model.in_chans", "3", *args]
    with pytest.raises(SystemExit) as exit_info:
        cli(lambda: entry.main(argv))
    assert exit_info.value.code == 2
    assert not torch.distributed.is_initialized() and not out.exists()
    return capsys.readouterr().err


@pytest.mark.parametrize("entry, args, reader", [
    (finetune, (), "objective finetune trains its classifier on the labels (data.train_index)"),
    (linprobe, ("--optim.name", "adamw"),  # LARS would need ZeRO stage 0
     "objective linprobe trains its classifier on the labels (data.train_index)"),
    (pretrain, ("--config", str(CONFIGS / "mlomae" / "debug.json")),
     "objective mlomae splits the labeled shards and trains its level-II classifier on the labels (data.train_index)"),
], ids=["finetune", "linprobe", "mlomae"])
def test_objectives_that_read_labels_refuse_an_unlabeled_index(tmp_path, capsys, indexes, entry, args, reader):
    err = refused(tmp_path, capsys, entry, "--data.train_index", str(indexes["unlabeled"]), *args)
    assert f"{reader}, but the shard index {indexes['unlabeled']} is unlabeled" in err
    assert "python -m data.index_shards SHARDS... --out INDEX.json --label_key KEY" in err
    assert "Objectives that read no labels (e.g. mae) pretrain on this index as it is" in err


def test_an_unlabeled_evaluation_index_is_refused(tmp_path, capsys, indexes):
    err = refused(tmp_path, capsys, linprobe, "--data.train_index", str(indexes["labeled"]), "--data.label_key",
                  "json:label", "--linprobe.num_classes", "3", "--optim.name", "adamw", "--data.eval_index",
                  str(indexes["unlabeled"]))
    assert (f"data.eval_index: data.eval_index is scored against its labels (top-1 / top-5), but the shard index "
            f"{indexes['unlabeled']} is unlabeled") in err


def test_a_labeled_index_is_read_only_under_its_own_label_key(tmp_path, capsys, indexes):
    err = refused(tmp_path, capsys, pretrain, "--data.train_index", str(indexes["labeled"]), "--data.label_key", "cls")
    assert (f"data.label_key is 'cls', but the labels of the shard index {indexes['labeled']} are under 'json:label' "
            f"(the key it was indexed with); pass --data.label_key json:label") in err


def test_a_malformed_label_key_is_refused_when_parsed():
    with pytest.raises(ConfigError, match=r"data.label_key: label key 'json:': .*MEMBER:FIELD \(e.g. json:label\)"):
        parse_args(["--ds_config", str(CPU_DS), "--config", str(DEBUG_PRESET), "--data.label_key", "json:"])
