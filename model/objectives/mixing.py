"""Image mixing for MixedAE (Chen et al. 2023, arXiv:2303.17152, section 3), done on device inside the objective.

The batch splits into groups of g = 1/r consecutive images. A random assignment M gives every
mixing cell (cell x cell patches) of a group one source image i in {0..g-1}, so each image owns
a share r of the cells: exactly C/g when g divides the cell count C, otherwise C//g or C//g + 1
(which images get the extra cell is random). Patch order is row-major, as everywhere.

- compose: one mixed image per group, x_mix = sum_i 1(M = i) x_i (the appendix's default).
- full: g mixed images per group from the cyclic shifts (M + j) mod g, j = 0..g-1, so every cell
  of every image appears exactly once across the group.

A `Mixing` describes the result per position, so the same indices mix pixels, tokens or targets.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from model.objectives.patches import patchify, unpatchify

MODES = ("compose", "full")


class Mixing(NamedTuple):
    source: torch.Tensor  # (Bm, N) long: batch index of the image each position comes from
    segment: torch.Tensor  # (Bm, N) long in [0, g): that image's index within its group
    group_size: int  # g
    per_group: int  # mixed images per group: 1 (compose) or g (full)

    def source_of(self, segment: int | torch.Tensor) -> torch.Tensor:
        """(Bm,) or broadcast: batch index of the image with `segment` in each mixed image's group."""
        group = torch.arange(self.source.shape[0], device=self.source.device) // self.per_group
        if isinstance(segment, torch.Tensor):
            return group.view(-1, *([1] * (segment.ndim - 1))) * self.group_size + segment
        return group * self.group_size + segment


def cell_assignment(num_groups: int, num_cells: int, g: int, exact: bool, device: torch.device,
                    generator: torch.Generator | None = None) -> torch.Tensor:
    """(num_groups, num_cells) long: the source index in [0, g) of each cell, balanced per group."""
    if num_cells < g:
        raise ValueError(f"{num_cells} mixing cells cannot be shared by g = {g} images; use a smaller cell size")
    if exact and num_cells % g:
        raise ValueError(
            f"{num_cells} mixing cells do not split exactly into g = {g} equal shares; choose a cell size "
            f"whose cell count is a multiple of g, or allow counts that differ by one (exact_counts false)"
        )
    # Which images own the C % g extra cells: a random relabelling of 0..g-1 per group.
    relabel = torch.rand(num_groups, g, device=device, generator=generator).argsort(dim=1)  # (G, g)
    balanced = relabel[:, torch.arange(num_cells, device=device) % g]  # (G, C): counts C//g (+1)
    order = torch.rand(num_groups, num_cells, device=device, generator=generator).argsort(dim=1)
    return balanced.gather(1, order)  # random positions for those labels


def make_mixing(batch_size: int, grid_size: tuple[int, int], cell: int, g: int, mode: str, exact: bool,
                device: torch.device, generator: torch.Generator | None = None) -> Mixing:
    """Draw a mixing for a batch of `batch_size` images on a (gh, gw) patch grid; cell in patches."""
    if mode not in MODES:
        raise ValueError(f"mixing mode {mode!r} is unknown; choose one of {MODES}")
    if batch_size % g:
        raise ValueError(
            f"the micro-batch of {batch_size} images does not split into groups of g = 1/r = {g}: set "
            f"train_micro_batch_size_per_gpu in the ds_config to a multiple of {g}"
        )
    gh, gw = grid_size
    if gh % cell or gw % cell:
        raise ValueError(f"a {gh}x{gw} patch grid does not tile into {cell}x{cell}-patch mixing cells")
    rows, cols = torch.meshgrid(torch.arange(gh, device=device), torch.arange(gw, device=device), indexing="ij")
    cell_of_patch = ((rows // cell) * (gw // cell) + cols // cell).flatten()  # (N,)
    cells = cell_assignment(batch_size // g, (gh // cell) * (gw // cell), g, exact, device, generator)
    segment = cells[:, cell_of_patch]  # (G, N)
    per_group = 1
    if mode == "full":
        shifts = torch.arange(g, device=device)[None, :, None]
        segment = ((segment[:, None, :] + shifts) % g).flatten(0, 1)  # (G*g, N)
        per_group = g
    group = torch.arange(segment.shape[0], device=device)[:, None] // per_group
    return Mixing(group * g + segment, segment, g, per_group)


def mix(x: torch.Tensor, mixing: Mixing) -> torch.Tensor:
    """Per-position values (B, N, ...) -> (Bm, N, ...) of the mixed images."""
    positions = torch.arange(x.shape[1], device=x.device)[None, :]
    return x[mixing.source, positions]


def unmix(mixed: torch.Tensor, mixing: Mixing, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `mix`: (Bm, N, ...) -> (B, N, ...) source values and a (B, N) bool of positions
    present in some mixed image (all of them in full mode, the image's own cells in compose mode)."""
    N = mixed.shape[1]
    positions = torch.arange(N, device=mixed.device)[None, :].expand_as(mixing.source)
    out = mixed.new_zeros(batch_size, *mixed.shape[1:])
    out[mixing.source, positions] = mixed
    covered = torch.zeros(batch_size, N, dtype=torch.bool, device=mixed.device)
    covered[mixing.source, positions] = True
    return out, covered


def mix_images(images: torch.Tensor, mixing: Mixing, patch_size: int) -> torch.Tensor:
    """(B, C, H, W) -> (Bm, C, H, W) mixed images, cut along patch (hence cell) borders."""
    B, C, H, W = images.shape
    mixed = mix(patchify(images, patch_size), mixing)
    return unpatchify(mixed, patch_size, (H // patch_size, W // patch_size), C)
