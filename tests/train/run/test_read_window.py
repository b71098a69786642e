"""train/run/loop.py's read_window over ranks: a logged scalar is the plain mean of every rank's
values (not their sum), a non-finite loss is left out of it and counted once over all ranks, the
data counters are summed and the engine's device state (the same on every rank) is read as it is."""
import json
import math
import textwrap

from conftest import run_ranks

# Each rank reads the windows of WINDOWS (its own values: WINDOWS[case][rank]) and writes what it
# logged to argv[1].<rank>.json.
WINDOWS = {
    "finite": [{"loss": [1.0, 3.0], "recon": [0.5]}, {"loss": [2.0, 4.0], "recon": [1.5]}],
    "one_nan": [{"loss": [1.0, math.nan], "recon": [0.5]}, {"loss": [2.0, 6.0], "recon": [1.5]}],
}
COUNTERS = [{"samples": 7, "skipped_files": 0}, {"samples": 9, "skipped_files": 2}]
SCRIPT = textwrap.dedent("""
    import json, sys
    import torch, torch.distributed as dist
    from train.run.loop import read_window

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    windows, counters = json.loads(sys.argv[2]), json.loads(sys.argv[3])
    logged = {case: read_window({k: [torch.tensor(v) for v in vs] for k, vs in per_rank[rank].items()},
                                {"skipped_steps": torch.tensor(3.0)}, counters[rank], torch.device("cpu"))
              for case, per_rank in windows.items()}
    with open(f"{sys.argv[1]}.{rank}.json", "w") as f:
        json.dump(logged, f)
    dist.destroy_process_group()
""")


def test_two_ranks_log_the_plain_mean_of_all_their_values(tmp_path):
    script, out = tmp_path / "read_window.py", tmp_path / "logged"
    script.write_text(SCRIPT)
    run_ranks(2, script, str(out), json.dumps(WINDOWS), json.dumps(COUNTERS))
    logged = [json.loads((tmp_path / f"logged.{rank}.json").read_text()) for rank in (0, 1)]
    assert logged[0] == logged[1]  # every rank logs the same
    finite, one_nan = logged[0]["finite"], logged[0]["one_nan"]
    # the plain mean over both ranks' values: (1 + 3 + 2 + 4) / 4, not twice it
    assert finite["loss"] == (1.0 + 3.0 + 2.0 + 4.0) / 4
    assert finite["recon"] == (0.5 + 1.5) / 2
    assert "nonfinite_losses" not in finite
    # rank 0's NaN is left out: the mean of the three finite losses, and one loss counted out
    assert one_nan["loss"] == (1.0 + 2.0 + 6.0) / 3 and one_nan["nonfinite_losses"] == 1
    assert one_nan["recon"] == (0.5 + 1.5) / 2
    for metrics in (finite, one_nan):
        assert metrics["samples"] == 7 + 9 and metrics["skipped_files"] == 0 + 2  # counters: summed
        assert metrics["skipped_steps"] == 3.0  # device state: the same on every rank, not reduced
