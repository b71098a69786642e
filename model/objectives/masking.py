"""Per-sample random masking by argsort of noise (MAE). Convention: mask 1 = removed, 0 = kept."""
from __future__ import annotations

from typing import NamedTuple

import torch


class Masking(NamedTuple):
    ids_keep: torch.Tensor  # (B, L) long: indices of kept patches, in shuffled order
    ids_restore: torch.Tensor  # (B, N) long: inverse permutation of the shuffle
    mask: torch.Tensor  # (B, N) float: 1 = removed, 0 = kept, original patch order


def num_kept(num_patches: int, mask_ratio: float) -> int:
    """floor(N * (1 - ratio)), as in MAE."""
    if not 0.0 <= mask_ratio < 1.0:
        raise ValueError(f"mask_ratio must be in [0, 1), got {mask_ratio}")
    return int(num_patches * (1 - mask_ratio))


def check_mask_ratio(option: str, mask_ratio: float, num_patches: int) -> None:
    """Refuse a ratio that masks no patch (the loss, a mean over masked patches, is 0/0 = NaN) or
    keeps none (the encoder sees only its cls token), counted as `num_kept` counts them."""
    keep = int(num_patches * (1 - mask_ratio))
    if keep < 1:
        raise ValueError(f"{option} {mask_ratio} keeps no patch of the {num_patches} (floor({num_patches} x "
                         f"(1 - {mask_ratio})) = 0): the encoder would see nothing; lower it (MAE: 0.75)")
    if keep >= num_patches:
        raise ValueError(f"{option} {mask_ratio} masks no patch of the {num_patches} (floor({num_patches} x "
                         f"(1 - {mask_ratio})) = {keep}): the loss, a mean over masked patches, would be NaN; "
                         f"raise it (MAE: 0.75)")


def masking_from_noise(noise: torch.Tensor, keep: int) -> Masking:
    """noise (B, N): the `keep` patches with the smallest noise are kept (stable order on ties)."""
    ids_shuffle = torch.sort(noise, dim=1, stable=True).indices  # ascending: small noise = keep
    ids_restore = torch.argsort(ids_shuffle, dim=1)
    mask = torch.ones(noise.shape, dtype=torch.float32, device=noise.device)
    mask[:, :keep] = 0
    mask = torch.gather(mask, 1, ids_restore)  # back to the original patch order
    return Masking(ids_shuffle[:, :keep], ids_restore, mask)


def check_supplied(key: str, given: torch.Tensor, batch_size: int, num_patches: int) -> None:
    """ValueError unless a caller-supplied `mask` / `mask_noise` is (images, patches): a smaller
    batch was broadcast against the targets (a wrong loss, no error), a longer row indexed past the
    patches."""
    if tuple(given.shape) != (batch_size, num_patches):
        raise ValueError(f"batch[{key!r}] must have shape (images, patches) = ({batch_size}, {num_patches}), "
                         f"got {tuple(given.shape)}")


def masking_from_mask(mask: torch.Tensor) -> Masking:
    """A caller-supplied binary mask (B, N), 1 = removed; every row must remove the same count,
    at least one patch and not all of them."""
    mask = mask.float()
    if not torch.all((mask == 0) | (mask == 1)):
        raise ValueError("a supplied mask must be binary (1 = removed, 0 = kept)")
    removed = mask.sum(dim=1)
    if not torch.all(removed == removed[0]):
        raise ValueError(f"every sample must remove the same number of patches, got counts {removed.tolist()}")
    if not 0 < int(removed[0]) < mask.shape[1]:
        raise ValueError(f"a supplied mask must remove at least one patch and keep at least one, got one removing "
                         f"{int(removed[0])} of {mask.shape[1]} (the loss is a mean over removed patches; the "
                         f"encoder sees the kept ones)")
    # Used as noise, the mask sorts kept patches (0) first, each group in ascending patch order.
    return masking_from_noise(mask, mask.shape[1] - int(removed[0]))


def random_masking(batch_size: int, num_patches: int, mask_ratio: float, device: torch.device) -> Masking:
    noise = torch.rand(batch_size, num_patches, device=device)  # uniform, per sample
    return masking_from_noise(noise, num_kept(num_patches, mask_ratio))


def gather_tokens(tokens: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """tokens (B, N, D), ids (B, L) -> (B, L, D)."""
    return torch.gather(tokens, 1, ids[..., None].expand(-1, -1, tokens.shape[-1]))
