"""train/run/evaluation.py's classification accuracy: top-1 and top-5 counted from the logits."""
import torch

import train.run.evaluation as evaluation
from data.shard_index import ShardSet


def test_top1_and_top5_count_where_the_true_class_ranks(monkeypatch):
    """10 classes, sample i of class i, its logits ranking class i at place i % 6 (0 = highest):
    top-1 counts the samples ranked first, top-5 those ranked in the first five."""
    labels, places = torch.arange(10), [i % 6 for i in range(10)]
    logits = torch.zeros(10, 10)
    for i, place in enumerate(places):
        order = [c for c in range(10) if c != i]
        order.insert(place, i)
        logits[i, order] = torch.arange(10.0, 0.0, -1.0)  # descending: order[0] highest

    def one_batch(shards, transform, batch_size, num_workers, skipped):
        yield torch.zeros(10, 1), labels

    monkeypatch.setattr(evaluation, "eval_batches", one_batch)
    shards = ShardSet(files=("a",), counts=(10,), classes=tuple(map(str, range(10))))
    result = evaluation.classification_accuracy(lambda images: logits, shards, 28, 1.0, 0, 1, torch.device("cpu"),
                                                torch.float32, num_workers=0)
    assert result["eval_top1"] == 100 * sum(p == 0 for p in places) / 10  # 20%
    assert result["eval_top5"] == 100 * sum(p < 5 for p in places) / 10  # 90%
    assert result["eval_samples"] == 10
