"""docs/GPU.md's one call on a GPU (`compile:230 methods:130 loader:170 --budget_s 530`): with every
item taking its whole estimate, each phase's share reaches the items that measure its targets, and
the call fits a command of ten minutes. The phases' GPU branches run on this CPU, their
measurements stood in."""
from pathlib import Path

import pytest
from compile_stand_ins import compile_stand_ins
from conftest import REPO


def _documented_shares() -> dict[str, float]:
    """docs/GPU.md's one call: each phase's share of it in seconds."""
    import re

    call = re.search(r"gpu_check ((?:\w+:\d+ )+)--budget_s\s+(\d+)", (REPO / "docs" / "GPU.md").read_text())
    shares = {name: float(s) for name, s in (p.split(":") for p in call.group(1).split())}
    assert sum(shares.values()) <= float(call.group(2)) <= 540  # a call of under 10 minutes, with its start
    return shares


def _planned_check(tmp_path, phase: str, share: float):
    """The phase's GPU branch on this CPU within `share` seconds, each item taking its whole estimate
    on a clock of its own."""
    from tools.gpu_check import Check

    class Planned(Check):
        spent = 0.0

        def remaining(self) -> float:
            return share - 5 - self.spent  # 5 s: the phase's own start (imports, versions)

        def item(self, name, estimate_s, fn):
            result = super().item(name, estimate_s, fn)
            self.spent += estimate_s if result is not None else 0
            return result

    check = Planned(phase, tmp_path, smoke=False, deadline=float("inf"), work=tmp_path / "work", log=tmp_path / "log")
    check.work.mkdir()
    check.cuda = True
    return check


def test_the_documented_one_call_plan_measures_the_loader_s_targets_within_its_share(tmp_path, monkeypatch):
    """docs/GPU.md's one call gives each phase a share; with every item taking its whole estimate,
    the loader's share reaches its targets' items (the shards, nvjpeg, the first end-to-end round).
    Its shard making alone was estimated above its share (90 s against 80), so the phase stopped there."""
    import types

    import benchmarks.photo_shards
    import tools.phases.common
    import tools.photos
    from tools.phases import loader

    shares = _documented_shares()

    def shards(argv):
        images = benchmarks.photo_shards.images_folder(Path(argv[1]))
        (images / "c0").mkdir(parents=True)
        (images / "c0" / "0.jpg").write_bytes(b"jpeg")
        Path(argv[1]).mkdir()
        Path(argv[1], "train-000000.tar").write_bytes(b"tar")

    monkeypatch.setattr(tools.photos, "write_photos", lambda *a: [])
    monkeypatch.setattr(benchmarks.photo_shards, "main", shards)
    monkeypatch.setattr(loader, "device_loader", lambda *a: {"images_per_s": 6000.0})
    monkeypatch.setattr(tools.phases.common, "our_bench", lambda check, argv: {"images_per_s": 3000.0})
    check = _planned_check(tmp_path, "loader", shares["loader"])
    loader.run(check, types.SimpleNamespace())
    ran = [k for k, v in check.record["items"].items() if "skipped" not in v]
    assert ran[:4] == ["make_shards", "decode_nvjpeg", "end_to_end_synthetic_r0", "end_to_end_shards_r0"], \
        check.record["items"]
    assert check.record["summary"]["end_to_end"]["shards_over_synthetic"] == 1.0


def test_the_documented_one_call_plan_measures_the_methods_targets_within_its_share(tmp_path, monkeypatch):
    """The methods phase's share of docs/GPU.md's one call, every item taking its whole estimate:
    both rounds of MAE, MixedAE, MAE+ and AdPE (the step ratios the targets name) and the TopK
    kernels against SDPA in bf16 run. When where each step goes came first (90 s), the share had
    no room left for AdPE or the kernels."""
    import json
    import types

    import kernels.bench
    import tools.gpu_check
    from tools import method_time
    from tools.phases import methods

    def kbench(argv):
        path = tmp_path / "kernels.json"
        path.write_text(json.dumps({"dtype": "bf16", "shapes": {"vit_b": {"results": {"dense_sdpa": {"ms": 1.0}},
                                                                          "ratios": {"topk_fused_over_dense": 1.4}}}}))
        return str(path)

    row = {"ms": {}, "step_ms": 1.0, "micro_batch": 64, "over_mae_measured": 1.0, "over_mae_counted": 1.0}
    monkeypatch.setattr(tools.gpu_check, "free_memory", lambda: None)  # its gc.collect per item: nothing to free
    monkeypatch.setattr(methods, "free_memory", lambda: None)
    monkeypatch.setattr(methods, "our_bench", lambda check, argv, torch_topk=False: {"step_time_s": 0.1})
    monkeypatch.setattr(kernels.bench, "main", kbench)
    monkeypatch.setattr(method_time, "main", lambda argv: {m: dict(row) for m in method_time.METHODS})
    monkeypatch.setattr(method_time, "markdown", lambda rows: "")
    check = _planned_check(tmp_path, "methods", _documented_shares()["methods"])
    methods.run(check, types.SimpleNamespace())
    items = check.record["items"]
    ran = [k for k, v in items.items() if "skipped" not in v]
    assert ran[:9] == ["mae_r0", "mixedae_r0", "maeplus_r0", "adpe_r0", "kernels_bf16",
                       "adpe_r1", "maeplus_r1", "mixedae_r1", "mae_r1"], items
    summary = check.record["summary"]
    assert {"mixedae_over_mae", "adpe_over_maeplus"} <= summary["step_ratios"].keys()
    assert summary["kernels_bf16"]["vit_b"]["topk_fused_over_dense"] == 1.4


def test_the_documented_one_call_plan_measures_the_compile_targets_within_its_share(tmp_path, monkeypatch):
    """The compile phase's share of docs/GPU.md's one call, every item taking its whole estimate:
    ViT-B at 128 eager and compiled in two rounds and MixedAE, MAE+ and AdPE compiled run, so the
    summary holds compiled over eager and both methods' ratios. With the equality (140 s) and the
    attention table (60 s) first, no compiled run fitted and the ratios were empty."""
    import types

    import tools.gpu_check
    from tools.phases import compile as phase

    monkeypatch.setattr(tools.gpu_check, "free_memory", lambda: None)
    compile_stand_ins(monkeypatch, [], None)
    check = _planned_check(tmp_path, "compile", _documented_shares()["compile"])
    phase.run(check, types.SimpleNamespace())
    items = check.record["items"]
    ran = [k for k, v in items.items() if "skipped" not in v]
    assert ran[:7] == ["vit_b_128_eager_r0", "vit_b_128_compiled_r0", "method_mixedae_compiled_r0",
                       "method_maeplus_compiled_r0", "method_adpe_compiled_r0", "vit_b_128_compiled_r1",
                       "vit_b_128_eager_r1"], items
    summary = check.record["summary"]
    rows = summary["throughput"]
    assert rows["vit_b_128_compiled"]["rounds"] == rows["vit_b_128_eager"]["rounds"] == 2
    assert summary["ratios"]["compile_over_eager_vit_b_128"] == pytest.approx(1.3)
    assert {"mixedae_over_mae", "adpe_over_maeplus"} <= summary["methods_compiled_micro128"].keys()


def test_the_documented_one_call_fits_a_command_of_ten_minutes():
    """The phases' shares within --budget_s, which leaves the start (imports, the first CUDA
    context) and the last item's overrun room under the device's 10 minutes a command."""
    shares = _documented_shares()
    assert set(shares) == {"compile", "methods", "loader"} and sum(shares.values()) <= 530
