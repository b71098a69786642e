"""The linear probe's BatchNorm statistics on several ranks: each rank updates them from its own
batches; before an evaluation every rank takes rank 0's (DDP's default, MAE's code), so all ranks
score with one classifier, the one a checkpoint holds."""
import textwrap

from conftest import run_ranks

SCRIPT = textwrap.dedent("""
    from types import SimpleNamespace
    import torch, torch.distributed as dist
    from model import create_model
    from model.objectives import build_objective
    from model.objectives.linear_probe import LinearProbeConfig
    from train.engine import EngineConfig, build, distributed
    from train.engine.optim import WarmupCosineSchedule, build_optimizer, build_param_groups

    rank, _, _ = distributed.init()
    torch.manual_seed(0)
    probe = build_objective("linprobe", create_model("vit_debug_patch4"), LinearProbeConfig(num_classes=5))
    groups, _ = build_param_groups(probe, 0.0, 1.0)
    engine = build(probe, groups, lambda g: build_optimizer(g, SimpleNamespace(name="lars")),
                   lambda o: WarmupCosineSchedule(o, 0.1, 0.0, 0, 10), EngineConfig(0, "fp32", 1, 0.0),
                   torch.device("cpu"))
    probe.train()
    data = torch.Generator().manual_seed(100 + rank)  # each rank its own batches
    for _ in range(3):
        out = engine({"image": torch.randn(8, 3, 28, 28, generator=data), "label": torch.randint(0, 5, (8,), generator=data)})
        engine.backward(out["loss"])
        engine.step()
    bn = probe.head[0]
    def gathered(t):
        ts = [torch.zeros_like(t) for _ in range(2)]
        dist.all_gather(ts, t)
        return ts
    means, variances = gathered(bn.running_mean), gathered(bn.running_var)
    assert not torch.equal(means[0], means[1]) and not torch.equal(variances[0], variances[1])
    weights = gathered(probe.head[1].weight.detach().clone())
    assert torch.equal(weights[0], weights[1])  # the head itself is the same on every rank
    engine.share_running_stats()
    assert torch.equal(bn.running_mean, means[0]) and torch.equal(bn.running_var, variances[0])
    assert int(bn.num_batches_tracked) == 3
    probe.eval()
    x = torch.randn(4, 3, 28, 28, generator=torch.Generator().manual_seed(7))
    logits = gathered(probe.predict(x))
    assert torch.equal(logits[0], logits[1])
    dist.destroy_process_group()
""")


def test_before_an_evaluation_every_rank_takes_rank_0s_statistics(tmp_path):
    script = tmp_path / "running_stats.py"
    script.write_text(SCRIPT)
    run_ranks(2, script)
