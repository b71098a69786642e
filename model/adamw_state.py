"""AdamW's per-tensor state made before the first step, as torch's fused kernel keeps it: the
moments beside the tensor and the step count a device tensor (fp32), so no step reads a count on
the host and a checkpoint has state to load into from the start. The engine's optimizer and the
objectives that keep optimizers of their own (MLO-MAE's masking network and head) both use it."""
from __future__ import annotations

import torch


def adamw_state(t: torch.Tensor) -> dict[str, torch.Tensor]:
    """torch's AdamW state for `t` before its first step."""
    return {"step": torch.zeros((), dtype=torch.float32, device=t.device),
            "exp_avg": torch.zeros_like(t, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(t, memory_format=torch.preserve_format)}


def with_state(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """`optimizer` (AdamW) with the state of every parameter made now (the fused kernel's first
    step would make it lazily, after a check that refuses tensors off its devices, e.g. `meta`)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            optimizer.state[p] = adamw_state(p)
    return optimizer


def load_fused(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load an AdamW state dict into a fused `optimizer` and keep it fused: a state dict saved by
    torch's default AdamW brings `fused: False` in its groups and a step count on the host, which
    Optimizer.load_state_dict would both keep."""
    optimizer.load_state_dict(state)
    for group in optimizer.param_groups:
        group.update(fused=True, foreach=None)
        for p in group["params"]:
            # copies: load_state_dict keeps a tensor of the right dtype and device as given, and one
            # shared with the caller's state dict would be stepped by both optimizers (a step count
            # counting twice, moments updated twice)
            for key, value in optimizer.state.get(p, {}).items():
                if torch.is_tensor(value):
                    dtype = torch.float32 if key == "step" else value.dtype
                    optimizer.state[p][key] = value.to(p.device, dtype, copy=True)
