"""What the engine takes from the final ds_config (train/config/ds_config.py checked it)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from train.engine.loss_scale import LossScaleConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
DDP_BUCKET_MB = 25.0  # DDP's own default bucket size, used when the ds_config gives no reduce_bucket_size


@dataclass(frozen=True)
class EngineConfig:
    stage: int  # ZeRO stage 0-3
    precision: str  # the compute dtype: fp32 | bf16 | fp16
    accum: int  # micro-batches per optimizer step
    clip: float  # gradient_clipping: max global l2 norm, 0 = none
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    reduce: str = ""  # the dtype gradients are reduced in over ranks ("" = the compute dtype)
    bucket_elements: int = 0  # zero_optimization.reduce_bucket_size (DDP's buckets); 0 = DDP's default
    accumulate: str = ""  # data_types.grad_accum_dtype: ZeRO-1's micro-batches summed in ("" = the compute dtype)

    @classmethod
    def from_ds_config(cls, ds: dict) -> EngineConfig:
        from train.config.ds_config import grad_accum_dtype, precision, reduce_dtype, zero_stage

        prec = precision(ds)
        return cls(zero_stage(ds), prec, ds["gradient_accumulation_steps"], float(ds.get("gradient_clipping", 0.0)),
                   LossScaleConfig.from_section(ds.get("fp16", {})) if prec == "fp16" else LossScaleConfig(),
                   reduce_dtype(ds), int(ds.get("zero_optimization", {}).get("reduce_bucket_size", 0) or 0),
                   grad_accum_dtype(ds))

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.precision]

    @property
    def reduce_dtype(self) -> torch.dtype:
        return DTYPES[self.reduce or self.precision]

    @property
    def unsynced_dtype(self) -> torch.dtype:
        """The dtype ZeRO-1 sums a step's unsynced micro-batch gradients in: FSDP2 sums them in its
        reduce dtype, so the wider of the reduce dtype and data_types.grad_accum_dtype (fp32 there
        means: sum in fp32, still communicate in the reduce dtype)."""
        wanted = DTYPES[self.accumulate or self.precision]
        return torch.float32 if torch.float32 in (wanted, self.reduce_dtype) else self.reduce_dtype

    def describe(self, world: int) -> str:
        """Which engine trains on `world` ranks and what its communication overlaps (the start
        line, meta.json, the dry run)."""
        reduce = self.reduce or self.precision
        if world == 1:
            return (f"one rank, no wrapper (ZeRO-{self.stage}: nothing to shard, no communication); gradients summed "
                    f"in fp32{' master copies' if self.precision != 'fp32' else ''}")
        if self.stage == 0:
            when = ("every micro-batch (the 16-bit gradients are summed in fp32 after it)"
                    if self.precision != "fp32" and self.accum > 1 else "on the step's last micro-batch")
            return (f"ZeRO-0 on DDP ({world} ranks): gradients all-reduced in {reduce}, {self.bucket_mb():g} MiB "
                    f"buckets issued inside the backward as they fill, {when}")
        reduced = {1: f"on the step's last micro-batch (the earlier ones summed in "
                      f"{DTYPE_NAMES[self.unsynced_dtype]})" if self.accum > 1
                   else "once per step",
                   2: "every micro-batch", 3: "every micro-batch"}[self.stage]
        gathered = ("before each block's forward and again for its backward" if self.stage == 3
                    else "once per step, in the forward, the next block's while one computes")
        return (f"ZeRO-{self.stage} on FSDP2 ({world} ranks, one unit per transformer block + the root): gradients "
                f"reduce-scattered in {reduce} block by block inside the backward, {reduced}; weights all-gathered "
                f"in {self.precision} {gathered}")

    def bucket_mb(self) -> float:
        """DDP's bucket size in MiB: reduce_bucket_size elements (DeepSpeed's unit) of the compute dtype,
        in which DDP's buckets hold the gradients (a reduce dtype other than it is cast to in the comm
        hook, from the full bucket), else DDP's default."""
        if not self.bucket_elements:
            return DDP_BUCKET_MB
        return self.bucket_elements * self.dtype.itemsize / 2**20
