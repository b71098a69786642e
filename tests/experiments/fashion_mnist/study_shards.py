"""A --shards folder for study.py's tests: its sets say how many images they hold, and nothing is
decoded before an entry runs."""
import types

from experiments.fashion_mnist import study


def fake_shards(tmp_path, monkeypatch, images=60000):
    """tmp_path/shards with train.json and test.json, whose training set holds `images` images."""
    shards = tmp_path / "shards"
    shards.mkdir()
    for name in ("train.json", "test.json"):
        (shards / name).write_text("{}")
    monkeypatch.setattr(study.ShardSet, "from_index", staticmethod(lambda index: types.SimpleNamespace(
        num_samples=images)))
    return shards
