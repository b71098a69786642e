"""A miniature objective, its parameter groups and data, a textbook AdamW loop to hold the
engine's steps against, and the engine's steps on it: shared by tests/train/engine/'s tests."""
import copy

import torch
from torch import nn

from train.engine import EngineConfig, build
from train.engine.loss_scale import LossScaleConfig
from train.engine.optim import WarmupCosineSchedule
from train.engine.replicated import ReplicatedEngine


class Tiny(nn.Module):
    """An objective in miniature: forward(batch) -> {"loss"}; a parameter the loss never reads."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 5)
        self.b = nn.Linear(5, 3)
        self.token = nn.Parameter(torch.randn(3))
        self.unused = nn.Parameter(torch.randn(2))
        self.register_buffer("shift", torch.full((3,), 0.5))

    def forward(self, batch):
        x = batch["image"]
        y = self.b(torch.tanh(self.a(x))) + self.token.to(x.dtype) + self.shift
        return {"loss": (y.float() - batch["target"]).square().mean()}

    def after_optimizer_step(self, lr, batches):
        return {}


class SkipsB(Tiny):
    """Batches marked skip_b leave b out of the loss: autograd never reaches it. With reach_b (the
    reference's copy) b stays in the graph at weight zero, so its gradient is zeros."""

    reach_b = False

    def forward(self, batch):
        if not batch.get("skip_b"):
            return super().forward(batch)
        x = batch["image"]
        h = torch.tanh(self.a(x))
        y = h[:, :3] + self.token.to(x.dtype) + self.shift
        if self.reach_b:
            y = y + 0 * self.b(h)
        return {"loss": (y.float() - batch["target"]).square().mean()}


def groups_of(module: nn.Module) -> list[dict]:
    decay = [module.a.weight, module.b.weight]
    rest = [module.a.bias, module.b.bias, module.token, module.unused]
    return [{"params": decay, "weight_decay": 0.05, "lr_scale": 0.5}, {"params": rest, "weight_decay": 0.0}]


def schedule(opt):
    return WarmupCosineSchedule(opt, peak_lr=0.05, min_lr=0.0, warmup_steps=2, total_steps=10)


def adamw(groups):
    return torch.optim.AdamW(groups, lr=0.0, betas=(0.9, 0.95), fused=True)


def batches(n: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"image": torch.randn(4, 6, generator=g), "target": torch.randn(4, 3, generator=g)} for _ in range(n)]


def reference_steps(module: Tiny, data: list[dict], accum: int, clip: float, dtype: torch.dtype) -> Tiny:
    """The textbook loop: fp32 master copy, the module in `dtype`, the micro-batches' gradients
    summed in fp32 (their mean), global-norm clipping, torch AdamW over the master weights, cast back."""
    master = copy.deepcopy(module)
    model = copy.deepcopy(module).to(dtype)
    groups = groups_of(master)
    opt = adamw(groups)
    sched = schedule(opt)
    pairs = list(zip(master.parameters(), model.parameters()))
    for i in range(0, len(data), accum):
        for batch in data[i:i + accum]:
            loss = model({**batch, "image": batch["image"].to(dtype)})["loss"] / accum
            loss.backward()
            for p32, p in pairs:
                if p.grad is not None:
                    p32.grad = p.grad.float() if p32.grad is None else p32.grad + p.grad.float()
                p.grad = None
        if clip:
            torch.nn.utils.clip_grad_norm_([p for p in master.parameters() if p.grad is not None], clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p32, p in pairs:
                p.copy_(p32)
    return master


def engine_steps(module: Tiny, data: list[dict], accum: int, clip: float, precision: str,
                 stage: int = 0) -> ReplicatedEngine:
    module = copy.deepcopy(module)
    scale = LossScaleConfig(initial_scale_power=8)  # 2**16 would overflow this model's fp16 gradients
    engine = build(module, groups_of(module), adamw, schedule, EngineConfig(stage, precision, accum, clip, scale),
                   torch.device("cpu"))
    assert isinstance(engine, ReplicatedEngine) and engine.ddp is None  # one rank: no wrapper, every stage
    for batch in data:
        loss = engine({**batch, "image": batch["image"].to(engine.dtype)})["loss"]
        engine.backward(loss)
        engine.step()
    return engine


def master_weights(engine: ReplicatedEngine) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in engine.master_weights().items()}
