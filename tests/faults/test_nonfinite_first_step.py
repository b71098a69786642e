"""A loss that is non-finite from the run's first step is blamed on the objective's configuration
and input, not on the lr (train/engine/nonfinite.py); a streak after finite steps still names the lr."""
from conftest import run_pretrain


def test_a_run_never_finite_names_the_objective_not_the_lr(tmp_path):
    proc = run_pretrain(tmp_path, "--run.max_steps", "6", "--run.max_nonfinite_steps", "3", "--mae.mask_ratio", "0.5",
                        faults="nan_loss@1-6", check=False)
    assert proc.returncode == 3
    assert "3 consecutive optimizer steps (1-3) had a non-finite loss or gradients" in proc.stderr
    assert "No step of this run had a finite loss, so the lr is an unlikely cause" in proc.stderr
    # the objective and its options set away from the defaults (mae/debug.json's decoder, the ratio given)
    assert "objective mae (mae.mask_ratio 0.5, mae.decoder_dim 32, mae.decoder_depth 1, mae.decoder_heads 2 set)" \
        in proc.stderr
    assert "lower optim.blr" not in proc.stderr
    assert not (tmp_path / "checkpoints" / "latest").exists()
