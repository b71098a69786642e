"""A shard stream continued on another number of readers delivers every sample of the epochs in
flight exactly once (data/reshard.py), and the loader positions that make it possible."""
from collections import Counter

import numpy as np
import pytest
import torch
from PIL import Image

from data.faults import CorruptDataError
from data.loader import ShardLoader
from data.reshard import ReaderLayout, consumed
from data.shard_index import ShardSet
from data.shards import ShardStream, StreamStart, sample_id
from data.write_shards import main as write_shards


def pixel_id(img, seed):
    """A sample's identity is its (uniform) pixel value."""
    return torch.tensor(int(np.asarray(img.convert("L"))[0, 0]))


def make_shards(root, n, per_shard):
    src = root / "src" / "c0"
    src.mkdir(parents=True)
    for v in range(n):
        Image.fromarray(np.full((4, 4), v, dtype=np.uint8)).save(src / f"{v}.png")
    write_shards(["imagefolder", str(root / "src"), str(root / "s"), "--samples_per_shard", str(per_shard)])
    return ShardSet.from_index(root / "s" / "train.json")


def next_ids(loader):
    return next(loader)["image"].flatten().tolist()


def loader(shards, rank, world, workers, buffer=5):
    return ShardLoader(shards, 4, batch_size=1, seed=7, rank=rank, world=world, num_workers=workers,
                       shuffle_buffer=buffer, transform=pixel_id)


def delivered(stream: ShardStream, worker: int, upto: tuple[int, int]) -> dict[int, list[str]]:
    """Sample ids per epoch a reader delivers up to position `upto` (inclusive)."""
    out: dict[int, list[str]] = {}
    for epoch, pos, raw in stream.worker_samples(worker, Counter(), with_data=False):
        if (epoch, pos) > upto:
            return out
        out.setdefault(epoch, []).append(sample_id(raw))


def test_consumed_lists_exactly_what_old_readers_delivered_across_epochs(tmp_path):
    shards = make_shards(tmp_path, 53, 5)  # 11 uneven shards: readers run at different speeds
    world, workers, buffer = 2, 2, 4
    # old readers stopped at different places, two of them already in epoch 1
    last = ((1, 3), (0, 9), (1, 0), (0, -1))
    old_ids: dict[int, list[str]] = {}
    for reader, upto in enumerate(last):
        rank, worker = divmod(reader, workers)
        stream = ShardStream(shards, None, 7, rank, world, workers, buffer)
        for epoch, ids in delivered(stream, worker, upto).items():
            old_ids.setdefault(epoch, []).extend(ids)
    layout = ReaderLayout(7, world, workers, buffer, last)
    start, skip = consumed(layout, shards)
    assert start == 0
    new_ids: dict[int, list[str]] = {}
    for worker in range(3):  # 1 rank x 3 workers read the rest of epochs 0 and 1
        stream = ShardStream(shards, None, 7, 0, 1, 3, buffer, StreamStart([], start, skip))
        for epoch, ids in delivered(stream, worker, (1, 10**6)).items():
            new_ids.setdefault(epoch, []).extend(ids)
    assert old_ids[1] and old_ids[0]  # the old readers really were in both epochs
    for epoch in (0, 1):
        both = old_ids.get(epoch, []) + new_ids[epoch]
        assert len(both) == 53 and len(set(both)) == 53, epoch  # each sample exactly once per epoch


def test_two_ranks_to_one_to_three_continue_the_epoch_without_repeats(tmp_path):
    shards = make_shards(tmp_path, 48, 6)  # 8 shards of 6
    first = [loader(shards, r, 2, 1) for r in range(2)]
    seen = [v for ld in first for _ in range(5) for v in next_ids(ld)]  # 10 samples, 5 per rank
    states = [ld.state_dict() for ld in first]
    one = loader(shards, 0, 1, 2)
    one.resume_from(states)
    seen += [v for _ in range(20) for v in next_ids(one)]
    # the 1-rank run checkpoints and continues (same world: its own position) ...
    again = loader(shards, 0, 1, 2)
    again.resume_from([one.state_dict()])
    seen += [v for _ in range(6) for v in next_ids(again)]
    # ... then moves to 3 ranks of 1 worker each, which finish the epoch between them
    three = [loader(shards, r, 3, 1) for r in range(3)]
    for ld in three:
        ld.resume_from([again.state_dict()])
    for ld in three:
        while True:
            ids = next_ids(ld)
            if ld.last[0][0] > 0:  # its first sample of epoch 1: epoch 0 is done on this rank
                break
            seen += ids
    assert sorted(seen) == list(range(48))  # epoch 0: every sample once, none skipped


# (old, new, old_batches): (world, workers) of the run that stopped and of the one continuing it, and
# the batches of one each old rank read; the last case stops deep into the epoch (26 of 48 read), so
# every new reader has consumed samples of its own shards to skip: rank r's workers are readers
# r*W .. r*W+W-1 of the new layout (rank 1 filtering by readers 1..2 delivered samples again).
@pytest.mark.parametrize("old, new, old_batches", [((2, 0), (1, 0), 4), ((1, 0), (1, 2), 4), ((2, 0), (3, 1), 4),
                                                   ((2, 2), (2, 0), 4), ((1, 1), (2, 2), 26)])
def test_readers_without_workers_continue_on_another_layout(tmp_path, old, new, old_batches):
    """data.num_workers 0 (auto on one core per rank) reads in the rank's own process, as one
    reader: a checkpoint of such ranks continues on another layout, and one continues on them."""
    shards = make_shards(tmp_path, 48, 6)
    (old_world, old_workers), (new_world, new_workers) = old, new
    first = [loader(shards, r, old_world, old_workers) for r in range(old_world)]
    seen = [v for ld in first for _ in range(old_batches) for v in next_ids(ld)]
    states = [ld.state_dict() for ld in first]
    for ld in first:
        ld.close()
    for rank in range(new_world):
        ld = loader(shards, rank, new_world, new_workers)
        ld.resume_from(states)
        for _ in range(48):  # batches of one: past this rank's share of epoch 0 whatever its workers' pace
            before = list(ld.last)
            ids = next_ids(ld)
            [(epoch, _)] = [now for now, then in zip(ld.last, before) if now != then]  # the worker that delivered
            seen += ids if epoch == 0 else []
        ld.close()
    assert sorted(seen) == list(range(48))  # epoch 0: every sample once, none skipped


def test_same_readers_continue_their_own_position_bit_identically(tmp_path):
    shards = make_shards(tmp_path, 48, 6)
    straight = loader(shards, 0, 1, 2)
    want = [next_ids(straight) for _ in range(30)]
    first = loader(shards, 0, 1, 2)
    got = [next_ids(first) for _ in range(11)]
    resumed = loader(shards, 0, 1, 2)
    resumed.resume_from([first.state_dict()])
    got += [next_ids(resumed) for _ in range(19)]
    assert got == want  # into the second epoch, in the same order


def test_reshard_refuses_another_seed(tmp_path):
    shards = make_shards(tmp_path, 24, 6)
    a = loader(shards, 0, 2, 1)
    b = ShardLoader(shards, 4, batch_size=1, seed=8, rank=0, world=1, num_workers=1, shuffle_buffer=5,
                    transform=pixel_id)
    with pytest.raises(ValueError, match="same seed"):
        b.resume_from([a.state_dict(), a.state_dict()])


def test_the_give_up_rule_counts_what_earlier_world_sizes_read(tmp_path):
    """data.max_bad_fraction's last check (check_unusable) divides the run's skipped samples by
    every sample read since it began: after a resume on another world size, the old ranks' samples
    too (the skipped counts carry over, so leaving them out stopped healthy runs at their last step)."""
    shards = make_shards(tmp_path, 48, 6)

    def reader(rank, world, workers):
        return ShardLoader(shards, 4, batch_size=1, seed=7, rank=rank, world=world, num_workers=workers,
                           shuffle_buffer=5, transform=pixel_id, max_bad_fraction=0.1)

    first = [reader(r, 2, 1) for r in range(2)]
    for ld in first:
        [next_ids(ld) for _ in range(5)]
    one = reader(0, 1, 2)
    one.resume_from([ld.state_dict() for ld in first])
    assert one.delivered() == 10
    [next_ids(one) for _ in range(3)]
    assert one.delivered() == 13
    three = [reader(r, 3, 1) for r in range(3)]
    for ld in three:  # a second change of world size keeps the count, on every rank
        ld.resume_from([one.state_dict()])
        assert ld.delivered() == 13
    skipped = {"data_skipped_undecodable_image": 1}
    three[0].check_unusable(skipped)  # 1 of 14 read: under 10%
    with pytest.raises(CorruptDataError, match="2 of 15 samples"):
        three[0].check_unusable({"data_skipped_undecodable_image": 2})
    same = reader(0, 1, 2)  # and the same world size continues the count
    same.resume_from([one.state_dict()])
    assert same.delivered() == 13


def test_delivered_on_rank_0_of_2_counts_both_ranks_batches(tmp_path):
    """delivered() is what all ranks delivered: each takes as many batches, so this rank's times the world size."""
    shards = make_shards(tmp_path, 24, 6)
    ld = ShardLoader(shards, 4, batch_size=2, seed=7, rank=0, world=2, num_workers=0, shuffle_buffer=5,
                     transform=pixel_id)
    for _ in range(3):
        next(ld)
    assert ld.delivered() == 3 * 2 * 2  # both ranks' 3 batches of 2


def test_the_old_runs_counters_carry_over_once_not_on_every_new_rank(tmp_path):
    """Counters are summed over ranks: after a change of world size rank 0 carries the old totals,
    the others start at zero (every rank taking them multiplied the old skips by the world size)."""
    shards = make_shards(tmp_path, 24, 6)
    old = loader(shards, 0, 1, 1)
    next_ids(old)
    state = old.state_dict()
    state["errors"] = [3] + state["errors"][1:]
    state["converted"] = [2] + state["converted"][1:]
    new = [loader(shards, r, 2, 1) for r in range(2)]
    for ld in new:
        ld.resume_from([state])
    counts = [ld.counters() for ld in new]
    skipped = [sum(v for k, v in c.items() if k.startswith("data_skipped_")) for c in counts]
    converted = [sum(v for k, v in c.items() if k.startswith("data_converted_")) for c in counts]
    assert (skipped, converted) == ([3, 0], [2, 0])
