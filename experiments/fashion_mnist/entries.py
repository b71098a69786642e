"""The study's design (study.py, report.py): which methods and variants it compares, the labels of
its tables, and its budgets by name. The papers' claims (claims.py) name these entries."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Entry:
    label: str  # as the tables say it
    method: str = ""  # a registered objective with a demo preset; "": no pretraining (a control)
    variant: str = ""  # one of train/configs/<method>/variants/, over the demo preset


# The study's design: which methods and variants it compares, and the labels of its tables. The
# paper claims report.py checks name these entries.
STUDY = {
    "mae": Entry("MAE", "mae"),
    "mixedae": Entry("MixedAE", "mixedae"),
    "mixedae_naive": Entry("MixedAE naive mixing", "mixedae", "naive_mixing"),
    "maeplus": Entry("MAE+ (RPE)", "maeplus", "maeplus_rpe"),
    "adpe": Entry("AdPE (RPE-coord, default)", "maeplus", "rpe_coord"),
    "mlomae": Entry("MLO-MAE", "mlomae"),
    "energy": Entry("Energy (mixture)", "energy"),
    "random_init": Entry("random init (control)"),
    "supervised": Entry("supervised from scratch (ceiling)"),
}
# Run only when named (--only): the MixedAE ablations of its Table A4 and MLO-MAE's unit unroll rates.
EXTRA = {
    "mixedae_homocon_only": Entry("MixedAE: HomoCon alone", "mixedae", "homocon_only"),
    "mixedae_no_segment": Entry("MixedAE without segment embeddings", "mixedae", "without_segment_embeddings"),
    "mixedae_without_mixing": Entry("MixedAE without mixing", "mixedae", "without_mixing"),
    "mixedae_masked_sa": Entry("MixedAE: masked self-attention", "mixedae", "masked_self_attention"),
    "mlomae_unit": Entry("MLO-MAE, unit unroll rates", "mlomae", "unit_unroll_lr"),
}
ENTRIES = STUDY | EXTRA
# The rows of the reports' tables: the methods and variants, then the controls (random init,
# supervised), whichever command (study.py, report.py) writes the report
REPORT_ORDER = sorted(ENTRIES, key=lambda name: not ENTRIES[name].method)
# Entries of the deciding study run at the ablation preset's budget (3 epochs) instead of 10, and judged
# there against the random-init control. Energy steps about 10x slower than MAE (one thread, 128
# images, median: 4.3-4.9 s against MAE's 0.44 s on the 2-core AMD EPYC dev machine, 3.18 s against
# 0.33 s on the 2-core Intel Xeon), so 10 epochs (4,680 steps) take 4 to 6 hours of one core; a
# machine replaced before a run ends loses it (docs/RESULTS_discussion.md). 3 epochs took 72-74 minutes
# (docs/RESULTS_ablation.md).
AT_ABLATION_BUDGET = ("energy",)

# Budgets by name (`--preset`): the quick one-third-epoch study (`make study`), the deciding
# 10-epoch study (`make study-full`) and the reduced 3-epoch budget (`ablation`): MixedAE's
# Table A4 ablations and energy, with MAE, MixedAE and random init again at that budget. Reports:
# report.paths(preset).
PRESETS = {
    "quick": {"pretrain_samples": 20000, "finetune_epochs": 1.0, "finetune_samples": 10000, "eval_epochs": "",
              "entries": list(STUDY)},
    "full": {"pretrain_samples": 600000, "finetune_epochs": 1.0, "finetune_samples": 60000, "eval_epochs": "1,3",
             # the longest first, for --jobs (2-core CPU, one thread each: MLO-MAE ~2 h, MAE ~45 min)
             "entries": ["supervised", "mlomae", "mlomae_unit", "adpe", "maeplus", "mixedae",
                         "mixedae_naive", "mae", "random_init"]},
    "ablation": {"pretrain_samples": 180000, "finetune_epochs": 1.0, "finetune_samples": 60000, "eval_epochs": "1",
                 "entries": ["energy", "mae", "mixedae", *(n for n in EXTRA if n.startswith("mixedae")), "random_init"]},
}
