"""The corrupt-fraction limit (data.max_bad_fraction): a reader gives up past it with a message naming
the shards and the fix, in the training process and from its loader workers (data/faults.py
BadSampleBudget, data/loader.py)."""
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_data_faults import REPO, image_shards, write_index, write_tar

from data.faults import BadSampleBudget, CorruptDataError, Tally
from data.loader import ShardLoader
from data.shard_index import ShardSet


def test_budget_rule():
    budget = BadSampleBudget(0.25, min_total=4, reader="rank 0 worker 0")
    budget.seen("a.tar")
    budget.skip("a.tar", "undecodable_image")  # 1 of 1, but fewer than min_total examined
    for _ in range(3):
        budget.seen("b.tar")  # 1 of 4 = 0.25: not above the limit
    with pytest.raises(CorruptDataError, match=r"a\.tar: 1 of 1 samples skipped \(undecodable_image 1\)"):
        budget.lose("c.tar", 1)  # 2 of 5
    never = BadSampleBudget(1.0, min_total=1, reader="r")
    never.lose("c.tar", 10)
    never.seen("c.tar")
    never.skip("c.tar", "empty_image")  # everything bad: 1.0 never gives up


def test_a_reader_of_exactly_min_total_samples_gives_up_at_its_last():
    # a reader whose whole stream is min_total samples, all bad: the rule applies from min_total on,
    # else such a reader would never give up
    budget = BadSampleBudget(0.1, min_total=10, reader="rank 0")
    for _ in range(9):
        budget.seen("s.tar")
        budget.skip("s.tar", "undecodable_image")
    assert (budget.total, budget.bad) == (9, 9)
    with pytest.raises(CorruptDataError):
        budget.seen("s.tar")
        budget.skip("s.tar", "undecodable_image")


def test_merged_tallies_count_past_the_examples_kept():
    shard = Tally()
    for i in range(25):
        shard.add(f"f{i}", "bad")
    total = Tally()
    total.merge(Tally())
    total.merge(shard)
    assert total.count == 25 and total.examples == [f"f{i}: bad" for i in range(Tally.MAX_EXAMPLES)]


@pytest.fixture
def one_bad_shard(tmp_path, request) -> tuple[Path, str]:
    """4 shards of 4 samples; one of them garbage images or a garbage file."""
    shards = image_shards(tmp_path, 3, 4)
    if request.param == "images":
        write_tar(tmp_path / "bad.tar", [(f"b{k}", {"jpg": b"\xff\xd8garbage", "cls": b"0"}) for k in range(4)])
    else:
        (tmp_path / "bad.tar").write_bytes(b"this is not a tar file" * 100)
    return write_index(tmp_path, {**shards, "bad.tar": 4}), str(tmp_path / "bad.tar")


@pytest.mark.parametrize("one_bad_shard", ["images", "tar"], indirect=True)
@pytest.mark.parametrize("workers", [0, 1])
def test_a_corrupt_shard_ends_training_and_is_named(one_bad_shard, workers):
    index, bad = one_bad_shard
    loader = ShardLoader(ShardSet.from_index(index), 8, batch_size=2, seed=0, rank=0, world=1, num_workers=workers,
                         shuffle_buffer=3, max_bad_fraction=0.1)
    with pytest.raises(CorruptDataError, match=re.escape(bad)) as e:  # in the main process, with its message
        for _ in range(20):
            next(loader)
    assert "data.max_bad_fraction" in str(e.value) and "rewrite" in str(e.value)


@pytest.mark.parametrize("one_bad_shard", ["images", "tar"], indirect=True)
def test_a_workers_corrupt_data_error_reaches_the_training_process_without_its_traceback(one_bad_shard):
    index, bad = one_bad_shard
    loader = ShardLoader(ShardSet.from_index(index), 8, batch_size=2, seed=0, rank=0, world=1, num_workers=1,
                         shuffle_buffer=3, max_bad_fraction=0.1)
    with pytest.raises(CorruptDataError) as e:
        for _ in range(20):
            next(loader)
    message = str(e.value)
    assert message.startswith("data reader rank 0 worker 0: ") and "Traceback" not in message, message
    assert bad in message and f"python -m data.verify {index}" in message


@pytest.mark.parametrize("one_bad_shard", ["tar"], indirect=True)
def test_the_process_exits_with_an_error_instead_of_waiting_for_its_workers(one_bad_shard):
    # Workers ignore SIGTERM (preemption is the training process's to handle), which used to make
    # a process that ended with a live loader wait for them forever.
    code = ("import sys; from data.loader import ShardLoader; from data.shards import ShardSet\n"
            "loader = ShardLoader(ShardSet.from_index(sys.argv[1]), 8, 2, 0, 0, 1, 2, 3, max_bad_fraction=0.1)\n"
            "for _ in range(20): next(loader)\n")
    proc = subprocess.run([sys.executable, "-c", code, str(one_bad_shard[0])], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 1 and "CorruptDataError" in proc.stderr and one_bad_shard[1] in proc.stderr


@pytest.mark.parametrize("one_bad_shard", ["images"], indirect=True)
def test_a_corrupt_fraction_of_1_never_ends_it(one_bad_shard):
    loader = ShardLoader(ShardSet.from_index(one_bad_shard[0]), 8, batch_size=2, seed=0, rank=0, world=1,
                         num_workers=0, shuffle_buffer=3, max_bad_fraction=1.0)
    for _ in range(20):  # 40 samples: more than 3 epochs of 12
        next(loader)
    assert loader.counters()["data_skipped_undecodable_image"] >= 12


def test_halting_on_decompression_bombs_names_the_pixel_limit(rgb_shards):
    """Images over data.max_image_pixels are often valid large photos: the reader's and the loader's
    give-up messages name the option that keeps them, besides rewriting the shards."""
    budget = BadSampleBudget(0.1, min_total=1, reader="rank 0 worker 0")
    with pytest.raises(CorruptDataError, match=r"decompression_bomb samples are images over data.max_image_pixels"
                                               r".*--data.max_image_pixels N") as e:
        budget.seen("a.tar")
        budget.skip("a.tar", "decompression_bomb")
    assert "Fix or rewrite these shards" in str(e.value)
    loader = ShardLoader(ShardSet.from_index(rgb_shards), 8, batch_size=1, seed=0, rank=0, world=1, num_workers=0,
                         shuffle_buffer=1, max_bad_fraction=0.1)
    with pytest.raises(CorruptDataError, match=r"by kind: decompression_bomb 2\).*--data.max_image_pixels N"):
        loader.check_unusable({"data_skipped_decompression_bomb": 2, "data_skipped_undecodable_image": 0})
    with pytest.raises(CorruptDataError) as e:  # other kinds: no word of the pixel limit
        loader.check_unusable({"data_skipped_decompression_bomb": 0, "data_skipped_undecodable_image": 2})
    assert "max_image_pixels" not in str(e.value)
