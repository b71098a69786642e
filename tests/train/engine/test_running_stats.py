"""The linear probe's BatchNorm statistics on several ranks: each rank updates them from its own
batches; before an evaluation every rank takes rank 0's (DDP's default, MAE's code), so all ranks
score with one classifier, the one a checkpoint holds."""
import textwrap

import torch
from conftest import run_ranks

# Each rank trains the probe 3 steps on its own batches, then calls share_running_stats(); rank 0
# writes every rank's statistics, head weights and logits, before and after, to the file argv[1].
SCRIPT = textwrap.dedent("""
    import sys
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
        batch = {"image": torch.randn(8, 3, 28, 28, generator=data),
                 "label": torch.randint(0, 5, (8,), generator=data)}
        out = engine(batch)
        engine.backward(out["loss"])
        engine.step()
    bn = probe.head[0]

    def gathered(t):
        ts = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(ts, t.contiguous())
        return torch.stack(ts)

    seen = {"mean_before": gathered(bn.running_mean), "var_before": gathered(bn.running_var),
            "head": gathered(probe.head[1].weight.detach())}
    engine.share_running_stats()
    probe.eval()
    x = torch.randn(4, 3, 28, 28, generator=torch.Generator().manual_seed(7))
    seen |= {"mean_after": gathered(bn.running_mean), "var_after": gathered(bn.running_var),
             "batches_tracked": gathered(bn.num_batches_tracked), "logits": gathered(probe.predict(x).detach())}
    if rank == 0:
        torch.save(seen, sys.argv[1])
    dist.destroy_process_group()
""")


def test_before_an_evaluation_every_rank_takes_rank_0s_statistics(tmp_path):
    script, out = tmp_path / "running_stats.py", tmp_path / "seen.pt"
    script.write_text(SCRIPT)
    run_ranks(2, script, str(out))
    seen = torch.load(out, weights_only=True)  # (ranks, ...) each
    assert torch.equal(seen["head"][0], seen["head"][1])  # the head itself is the same on every rank
    assert not torch.equal(seen["mean_before"][0], seen["mean_before"][1])  # the statistics drift apart
    assert not torch.equal(seen["var_before"][0], seen["var_before"][1])
    for rank in (0, 1):  # afterwards every rank holds rank 0's and scores as rank 0 does
        assert torch.equal(seen["mean_after"][rank], seen["mean_before"][0])
        assert torch.equal(seen["var_after"][rank], seen["var_before"][0])
        assert torch.equal(seen["logits"][rank], seen["logits"][0])
    assert seen["batches_tracked"].tolist() == [3, 3]
