import json
import math
import re
from pathlib import Path

import pytest
from fake_gpu import CU126_ARCHS, fake_gpu

from train.config.ds_config import float8_refusal, resolve, resolve_batch, zero_stage
from train.config.ds_keys import ENGINE_READS, ENGINE_VALUES
from train.config.errors import ConfigError
from train.config.options import PretrainConfig
from train.config.values import KINDS, Interval

REPO = Path(__file__).resolve().parents[3]


def _cfg(tmp_path, ds: dict, **model) -> PretrainConfig:
    p = tmp_path / "ds.json"
    p.write_text(json.dumps(ds))
    c = PretrainConfig(ds_config=str(p))
    for k, v in model.items():
        setattr(c.model, k, v)
    return c


BASE = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 0.0}


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "ds_configs").glob("*.json")))
def test_shipped_configs_state_clipping_and_resolve(name):
    path = REPO / "ds_configs" / name
    ds = json.loads(path.read_text())
    assert ds["gradient_clipping"] == 0.0  # the MAE recipe; DeepSpeed would clip at 1.0 otherwise
    gpu = "8x" in name
    cfg = PretrainConfig(ds_config=str(path))
    if name.startswith("linprobe"):
        cfg.optim.name = "lars"  # the probe's optimizer: must be accepted by its config
    final, plan = resolve(cfg, world=8 if gpu else 1, cuda=gpu, bf16_ok=True)
    if gpu:
        # the recipes' global batches: pretraining 4096, fine-tuning 1024, linear probe 16384, MLO-MAE and energy 256
        want = {"finetune": 1024, "linprobe": 16384, "mlomae": 256, "energy": 256}.get(name.split("_")[0], 4096)
        assert plan.global_batch == want == final["train_batch_size"]
        assert final["zero_optimization"]["stage"] == int(name.split("_zero")[1][0])  # as the name says
        assert ("v100" in name) == final["fp16"]["enabled"]
        assert ("bf16" in name) == final["bf16"]["enabled"] and not ("v100" in name and "bf16" in name)


def test_v100_configs_have_no_bf16_and_reject_a100_config_on_v100():
    a100 = REPO / "ds_configs" / "vit_b_8xa100_bf16_zero1.json"
    with pytest.raises(ConfigError, match="V100 has none"):
        resolve(PretrainConfig(ds_config=str(a100)), world=8, cuda=True, bf16_ok=False)


@pytest.mark.parametrize("gpu,allowed", [("v100", False), ("a100", True), ("h100", True)])
def test_bf16_follows_the_gpu_capability_not_emulation(tmp_path, gpu, allowed):
    """torch.cuda.is_bf16_supported() says True on a V100 (it counts emulation); bf16 needs sm80+."""
    cfg = _cfg(tmp_path, {**BASE, "bf16": {"enabled": True}})
    with fake_gpu(gpu, CU126_ARCHS):  # a torch build with kernels for all three
        if allowed:
            assert resolve(cfg, world=1)[0]["bf16"]["enabled"]
        else:
            with pytest.raises(ConfigError, match=r"bf16, which this GPU lacks .* \(this GPU: Tesla V100-SXM2-32GB, "
                                                  r"compute capability 7.0\)"):
                resolve(cfg, world=1)


def test_batch_derivation_and_contradiction():
    assert resolve_batch({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4}, 2).accum == 8
    assert resolve_batch({"train_batch_size": 64, "gradient_accumulation_steps": 4}, 2).micro == 8
    with pytest.raises(ConfigError, match="contradict the world size"):
        resolve_batch({"train_batch_size": 4096, "train_micro_batch_size_per_gpu": 64, "gradient_accumulation_steps": 8}, 16)
    with pytest.raises(ConfigError, match="not divisible"):
        resolve_batch({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}, 2)
    with pytest.raises(ConfigError, match="two of"):
        resolve_batch({"train_batch_size": 30}, 2)


@pytest.mark.parametrize("ds,world", [
    ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4}, 2),
    ({"train_batch_size": 64, "gradient_accumulation_steps": 4}, 2),
    ({"train_batch_size": 48, "gradient_accumulation_steps": 2}, 4),
    ({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 3}, 4),
])
def test_a_derived_batch_plan_keeps_the_global_batch_the_file_gives(ds, world):
    plan = resolve_batch(ds, world)
    assert plan.global_batch == plan.micro * plan.accum * world == ds["train_batch_size"]


@pytest.mark.parametrize("ds,world,message", [
    # 12 = 2 x 6 but not 2 x 4 ranks x a whole micro batch: DeepSpeed's rule needs tb % (ga x world) == 0
    ({"train_batch_size": 12, "gradient_accumulation_steps": 2}, 4, "not divisible by accumulation 2 x 4 ranks"),
    # 12 = 4 x 3 but not 4 x 2 ranks x whole steps
    ({"train_batch_size": 12, "train_micro_batch_size_per_gpu": 4}, 2, "not divisible by micro batch 4 x 2 ranks"),
])
def test_a_global_batch_that_does_not_split_over_the_ranks_is_refused_not_shrunk(ds, world, message):
    with pytest.raises(ConfigError, match=message):
        resolve_batch(ds, world)


@pytest.mark.parametrize("ds,world,fix", [
    # 4096 over 32 ranks is 128 per rank: micro 256 is too large; 128, 64, 32 take 1, 2, 4 accumulation steps
    ({"train_batch_size": 4096, "train_micro_batch_size_per_gpu": 256}, 32,
     "keep the recipe's global batch 4096 (the lr follows it) by setting train_micro_batch_size_per_gpu to "
     "128 (accumulation 1), 64 (accumulation 2) or 32 (accumulation 4)"),
    # 12 over 2 ranks is 6 per rank: of its divisors 6, 3, 2, 1 those at most the file's micro 4
    ({"train_batch_size": 12, "train_micro_batch_size_per_gpu": 4}, 2,
     "by setting train_micro_batch_size_per_gpu to 3 (accumulation 2), 2 (accumulation 3) or 1 (accumulation 6)"),
    # 24 does not divide 4096 (= 2**12): the powers of two around it do; 24 x 170 = 4080, 24 x 171 = 4104
    ({"train_batch_size": 4096, "train_micro_batch_size_per_gpu": 256}, 24,
     "no micro-batch splits 4096 over 24 ranks: keep the recipe's global batch on 16 or 32 ranks, or change the "
     "recipe to a train_batch_size that 24 ranks split, e.g. 4080 or 4104 (the lr follows it)"),
])
def test_a_micro_batch_too_large_for_the_world_size_is_told_how_to_keep_the_global_batch(ds, world, fix):
    """The global batch is the recipe's (the lr is derived from it): the refusal first names the
    micro-batches that keep it at this world size, and a new global batch only when none does."""
    with pytest.raises(ConfigError) as refusal:
        resolve_batch(ds, world)
    message = str(refusal.value)
    assert message.endswith(fix), message
    assert "multiple of" not in message


def test_a_ds_config_without_zero_optimization_is_zero_stage_0_as_in_deepspeed(tmp_path):
    assert zero_stage(BASE) == 0 and zero_stage({**BASE, "zero_optimization": {}}) == 0
    # and so LARS (whole tensors) is accepted by a file that says nothing of ZeRO
    cfg = _cfg(tmp_path, BASE)
    cfg.optim.name = "lars"
    assert resolve(cfg, world=1, cuda=False)[1].global_batch == 8


@pytest.mark.parametrize("stage,prec,refused", [
    (0, "fp32", False), (0, "fp16", False), (0, "bf16", True), (1, "fp32", True), (2, "fp32", True), (3, "fp32", True),
])
def test_lars_runs_only_on_whole_tensors_zero_stage_0_not_in_bf16(tmp_path, stage, prec, refused):
    ds = {**BASE, "zero_optimization": {"stage": stage}, **({prec: {"enabled": True}} if prec != "fp32" else {})}
    cfg = _cfg(tmp_path, ds)
    cfg.optim.name = "lars"
    if refused:
        with pytest.raises(ConfigError, match="optim.name lars needs whole per-layer tensors"):
            resolve(cfg, world=1, cuda=True, bf16_ok=True)
    else:
        resolve(cfg, world=1, cuda=True, bf16_ok=True)


@pytest.mark.parametrize("section,named", [
    ({"number_checkpoints": 4}, "number_checkpoints"),
    ({"partition_activations": True}, "partition_activations"),
])
def test_megatron_checkpointing_options_are_refused_not_ignored(tmp_path, section, named):
    with pytest.raises(ConfigError, match=f"activation_checkpointing sets .*{named}"):
        resolve(_cfg(tmp_path, {**BASE, "activation_checkpointing": section}), world=1, cuda=False)
    assert resolve(_cfg(tmp_path, {**BASE, "activation_checkpointing": {}}), world=1, cuda=False)  # the plain switch


@pytest.mark.parametrize("capability,runs", [((8, 0), False), ((8, 6), False), ((8, 9), True), ((9, 0), True),
                                              ((10, 0), True)])
def test_float8_runs_from_ada_compute_capability_8_9_on(capability, runs):
    """Ada (L40S, 8.9) has float8 tensor cores, as the refusal's own message says."""
    refusal = float8_refusal("some GPU", capability)
    assert (refusal is None) == runs
    if not runs:
        assert f"compute capability {capability[0]}.{capability[1]}; set run.float8 false" in refusal


@pytest.mark.parametrize("ds,model,cuda,message", [
    ({**BASE, "optimizer": {"type": "AdamW"}}, {}, False, "'optimizer' section"),
    ({**BASE, "scheduler": {"type": "WarmupLR"}}, {}, False, "'scheduler' section"),
    ({k: v for k, v in BASE.items() if k != "gradient_clipping"}, {}, False, "gradient_clipping explicitly"),
    ({**BASE, "fp16": {"enabled": True}, "bf16": {"enabled": True}}, {}, True, "both fp16 and bf16"),
    ({**BASE, "fp16": {"enabled": True}}, {}, False, "needs CUDA"),
    ({**BASE, "zero_optimization": {"stage": 4}}, {}, False, r"zero_optimization.stage \(the ZeRO stage\) must be in \[0, 3\], got 4"),
    (BASE, {"attn_backend": "flash_attn"}, True, "runs only in fp16/bf16.*use attn_backend sdpa"),
])
def test_contradictions_rejected(tmp_path, ds, model, cuda, message):
    with pytest.raises(ConfigError, match=message):
        resolve(_cfg(tmp_path, ds, **model), world=1, cuda=cuda, bf16_ok=True)


def test_missing_and_malformed_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        resolve(PretrainConfig(ds_config=str(tmp_path / "nope.json")), world=1)
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ConfigError, match="not valid JSON"):
        resolve(PretrainConfig(ds_config=str(bad)), world=1)


def _place(ds: dict, key: str, value) -> dict:
    section, _, sub = key.partition(".")
    out = json.loads(json.dumps(ds))
    if sub:
        out.setdefault(section, {})[sub] = value
    else:
        out[section] = value
    return out


@pytest.mark.parametrize("key", sorted(ENGINE_VALUES))
def test_every_value_the_engine_reads_has_a_type_and_the_wrong_one_is_refused(tmp_path, key):
    setting = ENGINE_VALUES[key]
    wrong = [5] if setting.kind is str else ["1", None, [1]] + ([0.5, True] if setting.kind is int else []) + \
        ([1] if setting.kind is bool else []) + ([float("nan"), float("inf"), True] if setting.kind is float else [])
    for value in wrong:
        with pytest.raises(ConfigError, match=rf"^ds_config {key}( \(.*\))? must be {KINDS[setting.kind]}, got "):
            resolve(_cfg(tmp_path, _place(BASE, key, value)), world=1)
    if setting.range:  # just past each finite bound
        interval = Interval.parse(setting.range)
        for bound, step in ((interval.lo, -1), (interval.hi, 1)):
            if math.isfinite(float(bound)):
                past = float(bound) + step * (1 if setting.kind is int else 1e-3)
                past = int(past) if setting.kind is int else past
                with pytest.raises(ConfigError, match=rf"^ds_config {key} .* must be {re.escape(str(interval))}, got"):
                    resolve(_cfg(tmp_path, _place(BASE, key, past)), world=1)


def test_the_sections_the_engine_reads_follow_from_its_values():
    assert ENGINE_READS["zero_optimization"] == {"stage", "overlap_comm", "reduce_bucket_size"}
    assert ENGINE_READS["gradient_clipping"] is None and ENGINE_READS["activation_checkpointing"] == set()
    assert {f"fp16.{k}" for k in ENGINE_READS["fp16"]} == {k for k in ENGINE_VALUES if k.startswith("fp16.")}


def test_settings_the_engine_behaves_as_anyway_must_hold_that_value_with_its_type(tmp_path):
    resolve(_cfg(tmp_path, {**BASE, "wall_clock_breakdown": False, "gradient_predivide_factor": 1}), world=1)
    for key, value in (("wall_clock_breakdown", 0), ("prescale_gradients", 0), ("gradient_predivide_factor", True)):
        with pytest.raises(ConfigError, match=f"ds_config {key} = {value!r} would not take effect"):
            resolve(_cfg(tmp_path, {**BASE, key: value}), world=1)


# value the engine behaves as, the other value, and the refusal's reason: FSDP2 all-gathers weights, the engine has
# no CPU offload (so no gradient copies to order over ranks) and no sequence parallelism
DEEPSPEED_AS_THE_ENGINE_DOES = {
    "zero_optimization.allgather_partitions": (True, False, "FSDP2 gathers the sharded weights with all-gathers"),
    "zero_optimization.round_robin_gradients": (False, True, "gradient copies to the CPU under optimizer offload"),
    "sequence_parallel_size": (1, 2, "the engine has no sequence parallelism"),
}


@pytest.mark.parametrize("key", sorted(DEEPSPEED_AS_THE_ENGINE_DOES))
def test_deepspeed_settings_at_the_value_the_engine_behaves_as_are_accepted_and_others_refused_with_why(tmp_path,
                                                                                                       key):
    does, other, why = DEEPSPEED_AS_THE_ENGINE_DOES[key]
    ds = {**BASE, "zero_optimization": {"stage": 1}}
    final, _ = resolve(_cfg(tmp_path, _place(ds, key, does)), world=1)
    section, _, sub = key.partition(".")
    assert (final[section][sub] if sub else final[section]) == does
    with pytest.raises(ConfigError, match=rf"^ds_config {re.escape(key)} = {other!r} would not take effect: .*{why}"):
        resolve(_cfg(tmp_path, _place(ds, key, other)), world=1)


@pytest.mark.parametrize("value", [False, True])
def test_sparse_gradients_is_refused_at_either_value_as_deepspeed_removed_it(tmp_path, value):
    """false is what the engine does (every gradient reduced dense), but DeepSpeed 0.19.8 refuses a file
    holding the key at all (deepspeed/runtime/config.py), so accepting it would pass a file DeepSpeed refuses."""
    with pytest.raises(ConfigError, match=rf"^ds_config sparse_gradients = {value!r} would not take effect: "
                                          r"DeepSpeed has removed it"):
        resolve(_cfg(tmp_path, {**BASE, "sparse_gradients": value}), world=1)


PRECISION_AS_THE_ENGINE_DOES = {  # the engine skips every non-finite step; masters and optimizer state are fp32
    "bf16": {"check_grad_overflow": True, "bf16_master_weights_and_grads": False, "bf16_optimizer_states": False},
    "bfloat16": {"check_grad_overflow": True, "bf16_master_weights_and_grads": False, "bf16_optimizer_states": False},
    "fp16": {"fp16_master_weights_and_grads": False},
}


@pytest.mark.parametrize("section", sorted(PRECISION_AS_THE_ENGINE_DOES))
def test_precision_settings_the_engine_behaves_as_anyway_are_accepted_and_their_opposites_refused(tmp_path, section):
    settings = PRECISION_AS_THE_ENGINE_DOES[section]
    ds = {**BASE, section: {"enabled": True, **settings}}
    final, _ = resolve(_cfg(tmp_path, ds), world=1, cuda=True, bf16_ok=True)  # fp16 and bf16 need a GPU
    assert final[section] == {"enabled": True, **settings}
    for key, value in settings.items():
        with pytest.raises(ConfigError, match=rf"^ds_config {section}\.{key} = {not value!r} would not take effect"):
            resolve(_cfg(tmp_path, {**BASE, section: {"enabled": True, key: not value}}), world=1, cuda=True)


def test_whole_numbers_written_as_floats_are_the_integers_they_are(tmp_path):
    ds = {"train_batch_size": 64.0, "train_micro_batch_size_per_gpu": 4.0, "gradient_clipping": 1,
          "zero_optimization": {"stage": 2.0}, "bfloat16": {"enabled": True}}
    final, plan = resolve(_cfg(tmp_path, ds), world=2)
    assert (plan.micro, plan.accum, plan.world) == (4, 8, 2) and all(type(n) is int for n in (plan.micro, plan.accum))
    assert final["train_batch_size"] == 64 and type(final["train_batch_size"]) is int
    from train.config.ds_config import precision, zero_stage

    assert zero_stage(final) == 2 and type(zero_stage(final)) is int
    assert precision(final) == "bf16"  # DeepSpeed's other spelling of the bf16 section


def test_the_fp16_sections_scaler_settings_reach_the_engine():
    """The ds_config's fp16 section sets the loss scaler as DeepSpeed's does; its other keys
    (enabled) are not scaler settings."""
    import torch

    from train.engine import EngineConfig, build
    from train.engine.loss_scale import LossScaleConfig
    from train.engine.optim import WarmupCosineSchedule

    fp16 = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1, "loss_scale_window": 50, "min_loss_scale": 4}
    cfg = EngineConfig.from_ds_config({**BASE, "fp16": fp16})
    assert cfg.precision == "fp16"
    assert cfg.loss_scale == LossScaleConfig(initial_scale_power=8, hysteresis=1, loss_scale_window=50,
                                             min_loss_scale=4)
    static = EngineConfig.from_ds_config({**BASE, "fp16": {"enabled": True, "loss_scale": 128}}).loss_scale
    assert static == LossScaleConfig(loss_scale=128) and not static.dynamic
    module = torch.nn.Linear(2, 2)
    engine = build(module, [{"params": list(module.parameters())}], lambda g: torch.optim.AdamW(g, lr=0.0, fused=True),
                   lambda o: WarmupCosineSchedule(o, 0.0, 0.0, 0, 1), cfg, torch.device("cpu"))
    assert engine.device_state()["loss_scale"].item() == 2.0 ** 8



def test_an_fp16_section_that_only_enables_it_takes_deepspeeds_documented_scaler_defaults():
    """DeepSpeed's ds_config reference (docs "fp16 training options"): loss_scale 0 (dynamic),
    initial_scale_power 16, loss_scale_window 1000, hysteresis 2, consecutive_hysteresis false,
    min_loss_scale 1; a file that names none of them gets those."""
    from train.engine import EngineConfig

    cfg = EngineConfig.from_ds_config({**BASE, "fp16": {"enabled": True}}).loss_scale
    assert (cfg.loss_scale, cfg.initial_scale_power, cfg.loss_scale_window) == (0, 16, 1000)
    assert (cfg.hysteresis, cfg.consecutive_hysteresis, cfg.min_loss_scale) == (2, False, 1)
    assert cfg.dynamic

@pytest.mark.parametrize("precision,given,summed", [
    ("bf16", None, "bf16"), ("bf16", "fp32", "fp32"), ("bf16", "float32", "fp32"), ("bf16", "torch.float32", "fp32"),
    ("bf16", "bfloat16", "bf16"), ("fp16", "half", "fp16"), ("fp16", "float", "fp32"), ("fp32", None, "fp32"),
])
def test_grad_accum_dtype_takes_deepspeeds_spellings_and_defaults_to_the_compute_dtype(tmp_path, precision, given,
                                                                                        summed):
    from train.engine import EngineConfig

    ds = {**BASE, "bf16": {"enabled": precision == "bf16"}, "fp16": {"enabled": precision == "fp16"},
          "zero_optimization": {"stage": 1}, **({"data_types": {"grad_accum_dtype": given}} if given else {})}
    final, _ = resolve(_cfg(tmp_path, ds), world=2, cuda=True, bf16_ok=True)
    assert EngineConfig.from_ds_config(final).accumulate == summed


@pytest.mark.parametrize("precision,given,message", [
    ("bf16", "fp16", "'fp16' is neither fp32 nor the compute dtype \\(bf16\\)"),
    ("fp32", "bf16", "'bf16' is neither fp32 nor the compute dtype \\(fp32\\)"),  # DeepSpeed: an unsupported mix
    ("bf16", "int8", "'int8' is not a dtype gradients can be summed in"),
    ("bf16", "FP32", "'FP32' is not a dtype"),  # DeepSpeed's names are case-sensitive
])
def test_a_grad_accum_dtype_no_engine_sums_in_is_refused(tmp_path, precision, given, message):
    ds = {**BASE, "bf16": {"enabled": precision == "bf16"}, "data_types": {"grad_accum_dtype": given}}
    with pytest.raises(ConfigError, match=f"^ds_config data_types.grad_accum_dtype {message}"):
        resolve(_cfg(tmp_path, ds), world=2, cuda=True, bf16_ok=True)


def test_data_types_other_than_grad_accum_dtype_are_refused(tmp_path):
    ds = {**BASE, "bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32", "param_dtype": "fp32"}}
    with pytest.raises(ConfigError, match="^ds_config data_types.param_dtype = 'fp32' would not take effect"):
        resolve(_cfg(tmp_path, ds), world=2, cuda=True, bf16_ok=True)


@pytest.mark.parametrize("clip", [0.7, 0.0])
def test_the_engine_takes_clipping_reduce_dtype_and_bucket_size_from_the_final_ds_config(tmp_path, clip):
    """The final ds_config is all the engine is told: gradient_clipping, communication_data_type and
    zero_optimization.reduce_bucket_size (elements) must arrive as the file states them."""
    from train.engine import EngineConfig

    ds = {**BASE, "gradient_clipping": clip, "communication_data_type": "bf16",
          "zero_optimization": {"stage": 0, "reduce_bucket_size": 1000}}  # DDP's buckets: ZeRO-0's
    final, _ = resolve(_cfg(tmp_path, ds), world=1, cuda=False)
    cfg = EngineConfig.from_ds_config(final)
    assert (cfg.stage, cfg.precision, cfg.accum, cfg.clip) == (0, "fp32", 2, clip)
    assert (cfg.reduce, cfg.bucket_elements, cfg.bucket_mb()) == ("bf16", 1000, 1000 * 4 / 2**20)  # fp32 buckets
    # left out: the compute dtype (DeepSpeed's default) and DDP's own buckets
    plain = EngineConfig.from_ds_config(resolve(_cfg(tmp_path, {**BASE, "gradient_clipping": clip}), world=1)[0])
    assert (plain.clip, plain.reduce, plain.bucket_elements, plain.bucket_mb()) == (clip, "fp32", 0, 25.0)
    # no stage given is DeepSpeed's stage 0, whose DDP buckets the size sets
    stageless = {**BASE, "zero_optimization": {"reduce_bucket_size": 1000}}
    implied = EngineConfig.from_ds_config(resolve(_cfg(tmp_path, stageless), world=1, cuda=False)[0])
    assert (implied.stage, implied.bucket_elements) == (0, 1000)


@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32"])
def test_without_communication_data_type_gradients_are_reduced_in_the_compute_dtype(tmp_path, precision):
    """DeepSpeed's default: bf16 training reduces in bf16, fp16 in fp16, fp32 in fp32."""
    from train.engine import EngineConfig

    ds = {**BASE, "bf16": {"enabled": precision == "bf16"}, "fp16": {"enabled": precision == "fp16"}}
    final, _ = resolve(_cfg(tmp_path, ds), world=2, cuda=True, bf16_ok=True)
    cfg = EngineConfig.from_ds_config(final)
    assert (cfg.precision, cfg.reduce) == (precision, precision)
