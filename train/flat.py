"""Where each trained parameter lives in the engine's flat buffers (train/engine.py).

The trained parameters, in optimizer-group order, are laid end to end in one vector of
`padded` elements; each starts at a multiple of ALIGN elements (aligned vector loads in the
multi-tensor kernels), and the end is padded to a multiple of ALIGN x world so that each rank
owns one contiguous shard of `shard_size` elements. Padding is zero and stays zero (zero
gradient, zero weight). The layout is recorded in checkpoints by parameter name, so a
checkpoint resumes on any world size and ZeRO stage.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

ALIGN = 64  # elements: 256 bytes of fp32


def _align(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class Slot:
    name: str
    offset: int  # first element in the flat vector
    numel: int
    shape: tuple[int, ...]
    group: int  # optimizer group index


@dataclass(frozen=True)
class Segment:
    """The part of one optimizer group inside one rank's shard: [start, end) of the flat vector."""
    group: int
    start: int
    end: int


class FlatLayout:
    def __init__(self, named_groups: list[list[tuple[str, nn.Parameter]]], world: int, align: int = ALIGN):
        slots, offset = [], 0
        self.group_ranges: list[tuple[int, int]] = []
        for g, params in enumerate(named_groups):
            begin = offset
            for name, p in params:
                slots.append(Slot(name, offset, p.numel(), tuple(p.shape), g))
                offset = _align(offset + p.numel(), align)
            self.group_ranges.append((begin, offset))
        self.slots: list[Slot] = slots
        self.world = world
        self.padded = _align(max(offset, 1), align * world)
        self.shard_size = self.padded // world
        self.by_name = {s.name: s for s in slots}

    def shard(self, rank: int) -> tuple[int, int]:
        return rank * self.shard_size, (rank + 1) * self.shard_size

    def segments(self, start: int, end: int) -> list[Segment]:
        """The optimizer groups' parts inside [start, end), in order (empty parts left out)."""
        out = []
        for g, (a, b) in enumerate(self.group_ranges):
            lo, hi = max(a, start), min(b, end)
            if lo < hi:
                out.append(Segment(g, lo, hi))
        return out

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each slot's tensor (its parameter's shape) as a view of a full-length `flat`."""
        return [flat[s.offset:s.offset + s.numel].view(s.shape) for s in self.slots]

    def describe(self) -> list[list]:
        """[name, offset, numel] per slot: what a checkpoint records."""
        return [[s.name, s.offset, s.numel] for s in self.slots]


def copy_ranges(dst: torch.Tensor, dst_start: int, dst_layout: dict[str, tuple[int, int]],
                src_pieces: list[tuple[dict[str, tuple[int, int]], int, torch.Tensor]]) -> None:
    """Fill `dst` (the flat range starting at dst_start of a layout {name: (offset, numel)}) from
    pieces of another layout: (its {name: (offset, numel)}, the piece's first flat element, the
    piece's values). Names match parameters across the layouts; elements of `dst` that no piece
    covers are left as they are."""
    dst_end = dst_start + dst.numel()
    for name, (d_off, numel) in dst_layout.items():
        lo, hi = max(d_off, dst_start), min(d_off + numel, dst_end)
        if lo >= hi:
            continue
        want = (lo - d_off, hi - d_off)  # the part of the parameter (flattened) this shard holds
        for layout, p_start, values in src_pieces:
            if name not in layout:
                continue
            s_off, s_numel = layout[name]
            if s_numel != numel:
                raise ValueError(f"parameter {name!r} has {s_numel} elements in the checkpoint, {numel} here")
            have = (max(want[0], p_start - s_off), min(want[1], p_start + values.numel() - s_off))
            if have[0] < have[1]:
                dst[d_off + have[0] - dst_start:d_off + have[1] - dst_start].copy_(
                    values[s_off + have[0] - p_start:s_off + have[1] - p_start])
