"""tools/phases/loader.py with its measurements stood in: the nvjpeg rate on a fake clock, the end
to end rates (means over the alternating rounds) with the budget estimates each round is given,
and the shards' mean JPEG size."""
import json
import time
import types
from pathlib import Path

import pytest
import torch


@pytest.fixture(autouse=True)
def no_collection(monkeypatch):
    """free_memory's gc.collect after every item (~0.4 s each in the suite's heap) frees nothing here."""
    import tools.gpu_check
    from tools.phases import loader

    for module in (tools.gpu_check, loader):
        monkeypatch.setattr(module, "free_memory", lambda: None)


def _check(tmp_path, cuda: bool, cls=None):
    from tools.gpu_check import Check

    check = (cls or Check)("loader", tmp_path, smoke=not cuda, deadline=float("inf"), work=tmp_path / "work",
                           log=tmp_path / "log")
    check.work.mkdir()
    check.cuda = cuda
    return check


def test_nvjpeg_images_per_s_counts_the_timed_batches_only(tmp_path, monkeypatch):
    """Each batch takes 0.05 s on a fake clock: the rate is micro / 0.05, the warm-up batches
    (drawn before the clock starts) neither in the images nor in the time."""
    import data.source
    from tools.phases import loader
    from tools.phases.common import CPU_DEBUG_DS

    clock = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])

    def source(*a, **k):
        while True:
            clock[0] += 0.05
            yield {"image": torch.zeros(8, 3, 4, 4)}

    monkeypatch.setattr(data.source, "build_source", source)
    common = ["--ds_config", str(CPU_DEBUG_DS), "--data.source", "shards", "--data.train_index", "/none/train.json",
              "--model.in_chans", "3"]
    out = loader.device_loader(_check(tmp_path, cuda=False), common, 3, 2)
    assert out["micro_batch"] == 8 and out["batches"] == 3 and out["batch_shape"] == [8, 3, 4, 4]
    assert out["images_per_s"] == pytest.approx(3 * 8 / (3 * 0.05))


def test_end_to_end_rates_are_means_over_the_alternating_rounds_and_the_first_gets_the_compile_s_estimate(
        tmp_path, monkeypatch):
    import tools.phases.common
    from tools.gpu_check import Check
    from tools.phases import loader

    estimates, sources = [], []

    class Recording(Check):
        def item(self, name, estimate_s, fn):
            estimates.append((name, estimate_s))
            return super().item(name, estimate_s, fn)

    rates = iter([1000.0, 900.0, 700.0, 1100.0])

    def ours(check, argv):
        sources.append(argv[argv.index("--data.source") + 1])
        return {"images_per_s": next(rates)}

    monkeypatch.setattr(tools.phases.common, "our_bench", ours)
    check = _check(tmp_path, cuda=True, cls=Recording)
    loader.end_to_end(check, tmp_path / "shards", 16)
    assert sources == ["synthetic", "shards", "shards", "synthetic"]
    # the first run compiles the blocks (60 s); the rest find inductor's cache warm (35 s)
    assert [e for _, e in estimates] == [60, 35, 35, 35]
    row = check.record["summary"]["end_to_end"]
    assert row["synthetic_images_per_s"] == pytest.approx((1000 + 1100) / 2)
    assert row["shards_images_per_s"] == pytest.approx((900 + 700) / 2)
    assert row["shards_over_synthetic"] == pytest.approx(800 / 1050)
    assert row["decode"] == "nvjpeg" and row["workers"] == 16


def test_the_loader_phase_reports_the_shards_mean_jpeg_size_in_kib(tmp_path, monkeypatch):
    """Two JPEGs of 2 KiB and 4 KiB: 3.0 KiB on average; the decoders' rates reach the summary."""
    import benchmarks.photo_shards
    import tools.photos
    import train.bench
    from tools.phases import loader

    def shards(argv):
        images = benchmarks.photo_shards.images_folder(Path(argv[1]))
        (images / "c0").mkdir(parents=True)
        (images / "c0" / "0.jpg").write_bytes(b"\0" * 2048)
        (images / "c0" / "1.jpg").write_bytes(b"\0" * 4096)
        Path(argv[1]).mkdir()
        Path(argv[1], "train-000000.tar").write_bytes(b"tar")

    def cpu_loader(argv):
        path = Path(argv[argv.index("--out_dir") + 1]) / "loader.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        rate = {"cpu": 100.0, "cpu_draft": 300.0}[argv[argv.index("--data.decode") + 1]]
        path.write_text(json.dumps({"loader": {"images_per_s": rate}}))
        return str(path)

    monkeypatch.setattr(tools.photos, "write_photos", lambda *a: [])
    monkeypatch.setattr(benchmarks.photo_shards, "main", shards)
    monkeypatch.setattr(train.bench, "main", cpu_loader)
    monkeypatch.setattr(loader, "device_loader", lambda *a: {"images_per_s": 6000.0})
    monkeypatch.setattr(loader, "end_to_end", lambda *a: None)
    check = _check(tmp_path, cuda=False)
    loader.run(check, types.SimpleNamespace())
    items, summary = check.record["items"], check.record["summary"]
    shards = items["make_shards"]
    assert shards == {"images": 2, "mean_kb": 3.0, "shards": 1, "seconds": shards["seconds"]}
    assert summary["jpeg_mean_kb"] == 3.0
    assert (summary["cpu_images_per_s"], summary["cpu_draft_images_per_s"], summary["nvjpeg_images_per_s"]) == (
        100.0, 300.0, 6000.0)


def test_the_nvjpeg_rate_waits_for_the_device_s_decodes(tmp_path, monkeypatch):
    """nvJPEG decodes on the device asynchronously: each batch here queues 0.05 s of device work and
    returns to the host after 0.001 s; torch.cuda.synchronize waits for the queue (a fake clock).
    The rate is the device's, micro / 0.05, not the host's."""
    import data.source
    from tools.phases import loader
    from tools.phases.common import CPU_DEBUG_DS

    clock, queued = [0.0], [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])

    def synchronize(*a):
        clock[0] += queued[0]
        queued[0] = 0.0

    def source(*a, **k):
        while True:
            clock[0] += 0.001
            queued[0] += 0.05
            yield {"image": torch.zeros(8, 3, 4, 4)}

    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    monkeypatch.setattr(data.source, "build_source", source)
    common = ["--ds_config", str(CPU_DEBUG_DS), "--data.source", "shards", "--data.train_index", "/none/train.json",
              "--model.in_chans", "3"]
    out = loader.device_loader(_check(tmp_path, cuda=True), common, 40, 8)
    assert out["images_per_s"] == pytest.approx(8 / 0.05, rel=0.03)  # the host's 1 ms a batch within it


def test_every_decoder_gets_warm_up_batches_before_the_clock_starts_on_the_gpu(tmp_path, monkeypatch):
    """The GPU branch: nvjpeg and the CPU decoders each draw 8 batches untimed (the workers' start,
    nvJPEG's handles), then 40 timed."""
    import benchmarks.photo_shards
    import tools.photos
    import train.bench
    from tools.phases import loader

    seen = {}

    def shards(argv):
        images = benchmarks.photo_shards.images_folder(Path(argv[1]))
        (images / "c0").mkdir(parents=True)
        (images / "c0" / "0.jpg").write_bytes(b"jpeg")
        Path(argv[1]).mkdir(exist_ok=True)
        Path(argv[1], "train-000000.tar").write_bytes(b"tar")

    def cpu_loader(argv):
        after = {a: argv[argv.index(a) + 1] for a in ("--data.decode", "--warmup", "--steps")}
        seen[after["--data.decode"]] = (after["--warmup"], after["--steps"])
        path = tmp_path / "loader.json"
        path.write_text(json.dumps({"loader": {"images_per_s": 1.0}}))
        return str(path)

    def device_loader(check, common, batches, warm):
        seen["nvjpeg"] = (str(warm), str(batches))
        return {"images_per_s": 6000.0}

    monkeypatch.setattr(tools.photos, "write_photos", lambda *a: [])
    monkeypatch.setattr(benchmarks.photo_shards, "main", shards)
    monkeypatch.setattr(train.bench, "main", cpu_loader)
    monkeypatch.setattr(loader, "device_loader", device_loader)
    monkeypatch.setattr(loader, "end_to_end", lambda *a: None)
    loader.run(_check(tmp_path, cuda=True), types.SimpleNamespace())
    assert seen == dict.fromkeys(("nvjpeg", "cpu", "cpu_draft"), ("8", "40"))
