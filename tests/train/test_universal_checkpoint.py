"""The universal-checkpoint conversion keeps an objective's extra state (AdPE's adversaries here),
which DeepSpeed's converter alone cannot read."""
import json

import torch
from conftest import REPO, run_pretrain

from train.checkpoint import UNIVERSAL, to_universal


def test_conversion_keeps_extra_state_and_every_trained_parameter(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 8, "gradient_clipping": 0.0,
                              "zero_optimization": {"stage": 2}, "bf16": {"enabled": False}}))
    run_pretrain(tmp_path / "run", "--config", str(REPO / "train/configs/maeplus/debug.json"), "--config",
                 str(REPO / "train/configs/maeplus/variants/rpe_coord.json"), "--run.max_steps", "2", ds_config=ds)
    tag = tmp_path / "run" / "checkpoints" / "step00000002"
    out = to_universal(tag)
    assert out == tag / UNIVERSAL and not list(tag.glob(".universal*"))  # temporary folders are gone
    original = torch.load(tag / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    converted = torch.load(out / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    extra = [k for k, v in original.items() if not isinstance(v, torch.Tensor)]
    assert extra and all(k in converted for k in extra)  # the adversaries travel with the universal checkpoint
    trained = [k for k, v in original.items() if isinstance(v, torch.Tensor) and v.dtype.is_floating_point]
    for name in trained:
        assert (out / "zero" / name / "fp32.pt").is_file(), name
    assert to_universal(tag) == out  # made once, then reused
