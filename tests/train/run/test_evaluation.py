"""train/run/evaluation.py's classification accuracy: top-1 and top-5 counted from the logits, each
rank's share of the shards and the counts summed over ranks; the features of an encoder in eval mode."""
import textwrap

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


def test_each_rank_reads_every_world_th_shard_from_its_own(monkeypatch):
    """4 shards of 2 samples on 2 ranks: rank 0 reads the first and third, rank 1 the second and
    fourth; each scores its 4 samples of the 8 listed (no process group: its counts are its own)."""
    read = []

    def batches(shards, transform, batch_size, num_workers, skipped):
        read.append(shards.files)
        for _ in shards.files:
            yield torch.zeros(2, 1), torch.tensor([0, 0])

    monkeypatch.setattr(evaluation, "eval_batches", batches)
    shards = ShardSet(files=("a", "b", "c", "d"), counts=(2, 2, 2, 2), classes=("x", "y"))
    for rank, mine in ((0, ("a", "c")), (1, ("b", "d"))):
        result = evaluation.classification_accuracy(lambda images: torch.tensor([[1.0, 0.0]]).expand(len(images), 2),
                                                    shards, 28, 1.0, rank, 2, torch.device("cpu"), torch.float32,
                                                    num_workers=0)
        assert read[-1] == mine
        assert (result["eval_samples"], result["eval_listed"], result["eval_top1"]) == (4, 8, 100.0)


# Two ranks score one shard each of a set listing 7 samples: rank 1's holds 3 it cannot decode.
# Each rank writes what it would log to argv[1].<rank>.txt.
TWO_RANKS = textwrap.dedent("""
    import sys
    import torch, torch.distributed as dist
    import train.run.evaluation as evaluation
    from data.shard_index import ShardSet

    dist.init_process_group("gloo")
    rank = dist.get_rank()

    def batches(shards, transform, batch_size, num_workers, skipped):
        if rank == 1:
            skipped["undecodable_image"] += 3
        yield torch.zeros(2, 1), torch.tensor([0, 0])

    evaluation.eval_batches = batches
    shards = ShardSet(files=("a", "b"), counts=(2, 5), classes=("x", "y"))
    result = evaluation.classification_accuracy(lambda images: torch.tensor([[1.0, 0.0]]).expand(len(images), 2),
                                                shards, 28, 1.0, rank, 2, torch.device("cpu"), torch.float32,
                                                num_workers=0)
    with open(f"{sys.argv[1]}.{rank}.txt", "w") as f:
        f.write(evaluation.eval_summary(result))
    dist.destroy_process_group()
""")


def test_samples_skipped_on_any_rank_are_reported_by_every_rank(tmp_path):
    """The skipped samples are summed over the ranks with the scored ones: rank 0, which skipped
    none, says what rank 1 skipped, and the counts add up to the 7 listed."""
    from conftest import run_ranks

    script = tmp_path / "accuracy.py"
    script.write_text(TWO_RANKS)
    run_ranks(2, script, str(tmp_path / "said"))
    for rank in (0, 1):
        assert (tmp_path / f"said.{rank}.txt").read_text() == (
            "top-1 100.00%, top-5 100.00% on 4 of 7 evaluation samples (3 skipped: undecodable_image 3)")


def test_features_are_those_of_the_encoder_in_eval_mode():
    """An encoder still in training mode (a run's own evaluation, mid-training) with stochastic depth:
    its features are the deterministic ones of eval mode, the same on every extraction."""
    from model import create_model

    torch.manual_seed(0)
    model = create_model("vit_debug_patch4", drop_path_rate=0.5)
    images, labels = torch.randn(6, 3, 28, 28), torch.arange(6) % 2
    decoded = evaluation.DecodedSet(images, labels, ("a", "b"), evaluation.Coverage(None, 6, 6, {}))
    model.train()
    first = evaluation.extract_features(model, decoded).features
    model.train()
    second = evaluation.extract_features(model, decoded).features
    with torch.no_grad():
        expected = model.eval().pooled_features(images, "cls")
    assert torch.equal(first, second) and torch.allclose(first, expected, atol=1e-6)
