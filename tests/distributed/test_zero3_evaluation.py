"""Evaluation under ZeRO-3: predict() runs outside the objective's forward, where FSDP2 would
hold the parameters sharded; the engine gathers them for it (train/engine/sharded.py gathered())."""
import json

import pytest
from conftest import run_pretrain

pytestmark = pytest.mark.distributed


def test_finetune_under_zero3_on_two_ranks_scores_its_head_on_the_eval_shards(tmp_path, rgb_shards, rgb_test_shards):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
                              "zero_optimization": {"stage": 3}}))
    run_pretrain(tmp_path / "run", "--objective", "finetune", "--finetune.num_classes", "3", "--data.source", "shards",
                 "--data.train_index", str(rgb_shards), "--data.eval_index", str(rgb_test_shards), "--data.num_workers",
                 "1", "--model.in_chans", "3", "--data.epoch_size", "0", "--run.max_steps", "2", ranks=2, ds_config=ds)
    result = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert result["step"] == 2 and 0.0 <= result["eval_top1"] <= 100.0 and result["eval_samples"] == 24
