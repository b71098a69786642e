"""tools/scaling.py: its numbers at a small case against a hand computation (parameters and FLOPs
counted here from the objective, not through train/estimate/scaling.py), and docs/PERFORMANCE.md's table
as the command the page names prints it today."""
import re
import subprocess
import sys

import pytest
import torch
from conftest import REPO

from tools.scaling import main

PAGE = REPO / "docs" / "PERFORMANCE.md"


def markdown_rows(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()
            if line.startswith("| ViT")]


def test_vit_b_zero1_on_four_nodes_by_hand(capsys):
    """ZeRO-1, bf16, 32 ranks on 4 nodes (100 GB/s per node across), global batch 4096: micro-batch
    128. Before: fp32 gradients reduce-scattered, the norm's fp32 scalar all-reduced, bf16 weights
    all-gathered, one after the other after the backward, nothing hidden. After: bf16 both ways."""
    from model.objectives import build_objective
    from model.objectives.mae import MAEConfig
    from model.registry import create_model
    from train.estimate.costs import profile

    with torch.device("meta"):
        mae = build_objective("mae", create_model("vit_base_patch16"), MAEConfig())
        flops = profile(mae, {"image": torch.zeros(128, 3, 224, 224)}).train_flops
    n = sum(p.numel() for p in mae.parameters() if p.requires_grad)
    assert main(["--markdown", "--ds_config", str(REPO / "ds_configs/vit_b_8xh100_bf16_zero1.json"),
                 "--world_size", "32"]) == 0
    (row,) = markdown_rows(capsys.readouterr().out)
    f = 31 / 32
    before_bytes, after_bytes = f * (4 * n + 2 * n) + 2 * f * 4, f * (2 * n + 2 * n) + 2 * f * 4
    compute = flops / (0.4 * 989e12)
    exposed = 3 * 30e-6 + before_bytes / 100e9
    assert row[:5] == ["ViT-B/16", "1", "32 (4)", "128 x 1", f"{compute * 1e3:.1f}"]
    assert row[5] == f"{before_bytes / 1e9:.3f} / {after_bytes / 1e9:.3f}"
    assert row[6].split(" / ")[0] == f"{exposed * 1e3:.2f}"
    assert row[7].split(" / ")[0] == f"{compute / (compute + exposed):.1%}"
    after_exposed = float(row[6].split(" / ")[1])
    assert 0 < after_exposed < exposed * 1e3 / 5  # most of it hidden


def test_the_text_report_names_every_collective_and_the_assumptions(capsys):
    assert main(["--ds_config", str(REPO / "ds_configs/cpu_debug.json"), "--config",
                 str(REPO / "train/configs/mae/debug.json"), "--world_size", "1", "16"]) == 0
    out = capsys.readouterr().out
    assert "1 GPU (1 node)" in out and "before: 0 B sent per rank per step (none)" in out
    assert "16 GPUs (2 nodes)" in out and "reduce_scatter gradients fp32" in out
    assert "all_gather weights fp32" in out and "all_reduce gradient norm fp32 8 B in 1" in out
    assert "bus bandwidth min(360, 100) GB/s" in out and "40% MFU" in out


def test_the_pages_table_is_what_its_command_prints():
    text = PAGE.read_text()
    section = text[text.index("## Scaling"):]
    section = section[:section.index("\n## ")]
    command = next(line.strip() for line in section.splitlines()
                   if line.strip().startswith("python -m tools.scaling --markdown"))
    proc = subprocess.run(["bash", "-c", command.replace("python", sys.executable, 1)], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    printed_table, printed_notes = proc.stdout.strip().split("\n\n")
    table = "\n".join(line for line in section.splitlines() if line.startswith("|"))
    assert table == printed_table, "docs/PERFORMANCE.md's Scaling table differs: run the command it names"
    notes = re.search(r"\nAssumptions: .*?\.\n\n", section, re.S).group(0)
    assert " ".join(notes.split()) == " ".join(printed_notes.split())
    rows = markdown_rows(printed_table)
    assert {r[0] for r in rows} == {"ViT-B/16", "ViT-L/16", "ViT-H/14"} and {r[2] for r in rows} == \
        {"8 (1)", "32 (4)", "128 (16)"}
    for r in rows:
        before, after = (float(x) for x in r[6].split(" / "))
        assert after <= before, r
        if not r[2].endswith("(1)"):
            assert after < before, r


@pytest.mark.parametrize("flag", [["--mfu", "0"], ["--world_size", "0"]])
def test_bad_values_are_refused(flag, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--ds_config", str(REPO / "ds_configs/cpu_debug.json"), *flag])
    assert e.value.code == 2


def test_the_gpu_a_file_names_sets_its_peak(capsys):
    """vit_b_8xa100_... and vit_b_8xh100_... hold the same settings: the a100 file is modelled on the
    A100's dense peak, the h100 file on the H100's (the debug model: the arithmetic is the same)."""
    from train.estimate.comm_model import Compute
    from train.estimate.gpus import gpu_named

    gpus = gpu_named("a100"), gpu_named("h100")
    files = [str(REPO / f"ds_configs/vit_b_8x{g}_bf16_zero1.json") for g in ("a100", "h100")]
    assert main(["--ds_config", *files, "--world_size", "8", "--config", str(REPO / "train/configs/mae/debug.json"),
                 "--model.name", "vit_debug_patch4"]) == 0
    out = capsys.readouterr().out
    headers = [line for line in out.splitlines() if " with " in line and ": ZeRO" in line]
    assert [h.split(": ZeRO")[0].endswith(f"on {g.name}") for h, g in zip(headers, gpus)] == [True, True]
    gflop = [float(x) for x in re.findall(r"([\d.e+-]+) training GFLOPs per sample", out)]
    batch = [int(m) * int(k) for m, k in re.findall(r"micro-batch (\d+) x accumulation (\d+)", out)]
    computed = [float(x) for x in re.findall(r"compute ([\d.e+-]+) ms per step", out)]
    for g, f, b, ms in zip(gpus, gflop, batch, computed):  # FLOPs / (MFU x the file's GPU's peak)
        assert ms == pytest.approx(f * 1e9 * b / (Compute.mfu * g.peak_tflops * 1e12) * 1e3, rel=1e-2), g.name
    assert len(computed) == 2


def test_gpu_given_wins_over_the_gpu_the_file_names(capsys):
    """--gpu a100 on the h100 file: the run is modelled on the A100's peak (the file's name is the
    default, not an override of what was asked)."""
    from train.estimate.comm_model import Compute
    from train.estimate.gpus import gpu_named

    a100 = gpu_named("a100")
    assert main(["--ds_config", str(REPO / "ds_configs/vit_b_8xh100_bf16_zero1.json"), "--gpu", "a100",
                 "--world_size", "8", "--config", str(REPO / "train/configs/mae/debug.json"),
                 "--model.name", "vit_debug_patch4"]) == 0
    out = capsys.readouterr().out
    (header,) = [line for line in out.splitlines() if " with " in line and ": ZeRO" in line]
    assert header.split(": ZeRO")[0].endswith(f"on {a100.name}")
    (gflop,) = [float(x) for x in re.findall(r"([\d.e+-]+) training GFLOPs per sample", out)]
    ((m, k),) = re.findall(r"micro-batch (\d+) x accumulation (\d+)", out)
    (ms,) = [float(x) for x in re.findall(r"compute ([\d.e+-]+) ms per step", out)]
    assert ms == pytest.approx(gflop * 1e9 * int(m) * int(k) / (Compute.mfu * a100.peak_tflops * 1e12) * 1e3, rel=1e-2)
