"""train/engine/'s checkpoints on one rank: a resume on the same or another ZeRO stage takes the
uninterrupted run's steps, and load itself refuses what does not fit or would run code."""
import pytest
import torch
from safetensors.torch import load_file
from tiny_engine import Tiny, adamw, batches, engine_steps, groups_of, master_weights, schedule

from train.engine import EngineConfig, build
from train.engine.optim import LARS
from train.engine.replicated import ReplicatedEngine


@pytest.mark.parametrize("stages", [(0, 2), (2, 0), (1, 1)])
def test_a_checkpoint_resumes_exactly_on_the_same_or_another_stage(tmp_path, stages):
    torch.manual_seed(0)
    module, data = Tiny(), batches(6)
    whole = engine_steps(module, data, 1, 0.0, "bf16", stages[0])
    first = engine_steps(module, data[:3], 1, 0.0, "bf16", stages[0])
    first.save(tmp_path, {"step": 3})
    assert {f.name for f in tmp_path.iterdir()} == {"model.safetensors", "optim", "state.pt"}
    saved = load_file(tmp_path / "model.safetensors")  # by name, as safetensors and timm read it
    assert saved["a.weight"].dtype == torch.float32 and torch.equal(saved["a.weight"], master_weights(first)["a.weight"])
    assert saved["shift"].dtype == torch.bfloat16  # buffers as the module holds them
    fresh = Tiny()  # other starting weights: everything must come from the checkpoint
    second = build(fresh, groups_of(fresh), adamw, schedule, EngineConfig(stages[1], "bf16", 1, 0.0),
                   torch.device("cpu"))
    assert second.load(tmp_path) == {"step": 3}
    for batch in data[3:]:
        second.backward(second({"image": batch["image"].to(torch.bfloat16), "target": batch["target"]})["loss"])
        second.step()
    assert second.steps == whole.steps == 6 and second.get_lr() == whole.get_lr()
    for name, value in master_weights(whole).items():
        assert torch.equal(master_weights(second)[name], value), name


class RunsCode:
    """Unpickling this calls open(marker, "w"): the file appearing means code ran."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def fresh_engine(optimizer=adamw, module=None) -> ReplicatedEngine:
    module = module or Tiny()
    return build(module, groups_of(module), optimizer, schedule, EngineConfig(0, "fp32", 1, 0.0), torch.device("cpu"))


def test_load_reads_the_optimizer_metadata_safely_again_and_runs_no_code(tmp_path):
    """The before-start check read the tag; a file swapped since is refused by load itself."""
    import pickle

    engine_steps(Tiny(), batches(1), 1, 0.0, "fp32").save(tmp_path, {"step": 1})
    marker = tmp_path / "ran"
    (tmp_path / "optim" / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    with pytest.raises(ValueError, match=r"^\S+/optim/\.metadata would unpickle _?io\.open; refused"):
        fresh_engine().load(tmp_path)  # the reader's own refusal, not DCP's BaseException around it
    assert not marker.exists()


def test_an_optimizer_shard_that_cannot_be_read_is_a_value_error_naming_the_folder(tmp_path):
    engine_steps(Tiny(), batches(1), 1, 0.0, "fp32").save(tmp_path, {"step": 1})
    shard = next((tmp_path / "optim").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:20])  # cut after the check a resume makes before start
    with pytest.raises(ValueError) as e:
        fresh_engine().load(tmp_path)
    assert str(e.value).startswith(f"{tmp_path / 'optim'} could not be read (rank 0: ") and "\n" not in str(e.value)


def test_a_tag_without_the_objectives_extra_state_does_not_fit_it(tmp_path):
    class WithExtra(Tiny):
        def get_extra_state(self):
            return {"k": 1}

        def set_extra_state(self, state):
            self.got = state

    engine_steps(Tiny(), batches(1), 1, 0.0, "fp32").save(tmp_path, {"step": 1})
    with pytest.raises(ValueError, match="does not fit this objective"):
        fresh_engine(module=WithExtra()).load(tmp_path)


def test_an_adamw_tag_is_refused_by_a_lars_engine_naming_both(tmp_path):
    engine_steps(Tiny(), batches(1), 1, 0.0, "fp32").save(tmp_path, {"step": 1})
    with pytest.raises(ValueError, match="holds AdamW state; this run's optimizer is LARS"):
        fresh_engine(lambda groups: LARS(groups, lr=0.0)).load(tmp_path)


def test_a_resume_in_a_non_finite_streak_keeps_the_streak_as_the_windows_worst():
    """Saved three skipped steps into a streak: after the resume, a finite step ends the streak, but
    the loop's next read still sees the three-step streak as the worst, as it would have without the resume."""
    from train.engine.nonfinite import DeviceHealth

    health = DeviceHealth(torch.device("cpu"))
    health.load_state_dict({"skipped": 3.0, "streak": 3.0})
    health.update(torch.tensor(0.0))  # the first step after the resume is finite
    values = {k: v.item() for k, v in health.tensors().items()}
    assert values == {"skipped_steps": 3.0, "nonfinite_streak": 0.0, "nonfinite_worst": 3.0}
