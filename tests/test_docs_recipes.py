"""Every training command of the README and the docs pages runs the recipe it claims: each
`deepspeed --num_gpus N train/{pretrain,finetune,linprobe}.py --ds_config ds_configs/<file> ...` and
`python train/...` command with a shipped ds_config is parsed and resolved for its world size, and
its global batch and peak lr (blr x global batch / 256) are checked against the recipe of the
method it trains (RECIPES: the papers' ImageNet recipes, as the method pages cite them)."""
from __future__ import annotations

import re
import sys

import pytest
from readme_commands import REPO, Doc, code_lines

from train.config.ds_config import resolve
from train.config.parsing import parse_args
from train.config.plan import peak_lr

PAGES = ["README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").rglob("*.md"))]
TRAINING = re.compile(r"^(deepspeed --num_gpus (\d+)|python) train/(pretrain|finetune|linprobe)\.py (.*)$")
# (entry point, the method's preset or None) -> (global batch, blr)
RECIPES = {
    ("pretrain", None): (4096, 1.5e-4),  # MAE, He et al. 2022 (arXiv:2111.06377), Table 8
    ("pretrain", "mixedae"): (4096, 7.5e-5),  # MixedAE, Chen et al. 2023 (arXiv:2303.17152), appendix
    ("pretrain", "maeplus"): (4096, 1.5e-4),  # AdPE / MAE+, Wang et al. 2023 (arXiv:2303.07598)
    ("pretrain", "mlomae"): (256, 1e-4),  # MLO-MAE, Guo et al. 2024 (arXiv:2402.18128), Table 11
    ("pretrain", "energy"): (256, 1e-4),  # energy-based pretraining, Wang et al. 2023 (arXiv:2302.01384)
    ("finetune", None): (1024, 5e-4),  # MAE's fine-tuning, Table 9 (ViT-B; ViT-L: blr 1e-3)
    ("linprobe", None): (16384, 0.1),  # MAE's linear probe, Table 10
}


def training_commands() -> list:
    """(snippet, world size, entry point, its arguments) of every training command with a shipped ds_config."""
    found = []
    for page in PAGES:
        for snippet in code_lines(Doc.read(page)):
            m = TRAINING.match(snippet.text)
            if not m or "..." in snippet.text or "<" in snippet.text or "--dry-run" in snippet.text:
                continue
            ds = re.search(r"--ds_config (ds_configs/\S+\.json)", snippet.text)
            if ds is None or "cpu_" in ds.group(1):
                continue
            found.append((snippet, int(m.group(2) or 1), m.group(3), m.group(4)))
    return found


COMMANDS = training_commands()


def test_the_docs_have_training_commands_of_every_entry_point():
    assert {entry for _, _, entry, _ in COMMANDS} == {"pretrain", "finetune", "linprobe"}


@pytest.mark.parametrize("snippet,world,entry,args", COMMANDS, ids=[c[0].where for c in COMMANDS])
def test_each_documented_command_trains_its_methods_recipe(snippet, world, entry, args, tmp_path):
    argv = snippet.argv({"shards": tmp_path / "shards", "runs": tmp_path / "runs", "/data": tmp_path / "data"})
    argv = argv[argv.index(next(a for a in argv if a.endswith(f"train/{entry}.py"))) + 1:]
    if entry != "pretrain":
        recipe = __import__(f"train.{entry}", fromlist=["RECIPE"]).RECIPE
        argv = [*recipe, *argv]
    if "--model.init_from" in argv:  # a file of the user's: the recipe does not depend on it
        i = argv.index("--model.init_from")
        argv = argv[:i] + argv[i + 2:]
    cfg = parse_args(argv)
    _, plan = resolve(cfg, world, cuda=True, bf16_ok=True)
    preset = next((name for name in ("mixedae", "maeplus", "mlomae", "energy") if f"configs/{name}/" in snippet.text),
                  None)
    batch, blr = RECIPES[entry, preset]
    if entry == "finetune" and "vit_large" in snippet.text:
        blr = 1e-3
    assert plan.global_batch == batch, f"{snippet.where}: global batch {plan.global_batch}, the recipe's is {batch}"
    assert peak_lr(cfg, plan) == pytest.approx(blr * batch / 256), f"{snippet.where}: peak lr {peak_lr(cfg, plan)}"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
