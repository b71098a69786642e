"""iRPE relative-position index functions (iRPE, Wu et al. 2021, arXiv:2107.14222; as AdPE uses them,
Wang et al. 2023, arXiv:2303.07598, section 4.2).

Relative offsets x = x_i - x_j (per axis, in patches) map to table indices by the piecewise
function g: exact (rounded) near the query, log-compressed further away, clipped at beta:

    g(x)  = round(x)                                                         |x| <= alpha
          = sign(x) * trunc(min(beta, round(alpha + ln(|x|/alpha) / ln(gamma/alpha) * (beta - alpha))))  otherwise

(the clip happens after rounding and the result is truncated to an integer, as in iRPE's code,
so with beta = 3.8 the indices are -3..3). The relaxed g~ (AdPE eq. for coordinate adversaries)
drops the rounding: g~(x) = x for |x| <= alpha, else sign(x) * min(beta, alpha + ...), a
continuous index used with bilinear interpolation of the table.

A 2-D offset (dx, dy) gets bucket (g(dy) + R) * S + (g(dx) + R), with R = floor(beta) and
S = 2R + 1 per axis: S*S = 49 buckets for the defaults, plus one extra bucket (index S*S) for
every pair that involves the cls token.

The continuous index reads the S x S bucket grid bilinearly in one of two ways (`COORD_LOOKUPS`):
  project   the paper's: grid point [k, l] = bucket (k + R) * S + (l + R) for k, l in -R..R, the
            index g~ clamped to [-R, R] (the same axes and points as the integer lookup)
  official  AdPE's official code: F.grid_sample of the bucket grid at g~ / beta (align_corners=False,
            zero padding), with the row offset on the grid's x (its column axis), so the point read
            for index u is ((u / beta + 1) * S - 1) / 2 per axis, axes swapped, and corners outside
            the grid weigh zero
"""
from __future__ import annotations

import math
from typing import Callable

import torch

ALPHA, BETA, GAMMA = 1.9, 3.8, 15.2
COORD_LOOKUPS = ("project", "official")  # how a continuous index reads the bucket grid (module docstring)


def _far(ax: torch.Tensor, alpha: float, beta: float, gamma: float) -> torch.Tensor:
    """alpha + ln(|x|/alpha) / ln(gamma/alpha) * (beta - alpha), for |x| > alpha."""
    return alpha + torch.log(ax.clamp_min(alpha) / alpha) / math.log(gamma / alpha) * (beta - alpha)


def piecewise_index(x: torch.Tensor, alpha: float = ALPHA, beta: float = BETA, gamma: float = GAMMA) -> torch.Tensor:
    """g: offsets (any shape, float) -> integer indices in [-floor(beta), floor(beta)] (long)."""
    ax = x.abs()
    far = torch.sign(x) * _far(ax, alpha, beta, gamma).round().clamp(max=beta)
    return torch.where(ax <= alpha, x.round(), far).trunc().long()


def relaxed_index(x: torch.Tensor, alpha: float = ALPHA, beta: float = BETA, gamma: float = GAMMA) -> torch.Tensor:
    """g~: the continuous version (no rounding), differentiable in x."""
    ax = x.abs()
    far = torch.sign(x) * _far(ax, alpha, beta, gamma).clamp(max=beta)
    return torch.where(ax <= alpha, x, far)


def axis_size(beta: float = BETA) -> int:
    """Indices per axis: 2 * floor(beta) + 1."""
    return 2 * math.floor(beta) + 1


def num_buckets(beta: float = BETA) -> int:
    """Table rows: S * S offset buckets plus one for pairs with the cls token."""
    return axis_size(beta) ** 2 + 1


def grid_coords(grid_size: tuple[int, int], device: torch.device | None = None) -> torch.Tensor:
    """(N, 2) float (row, col) of each patch, row-major."""
    rows, cols = torch.meshgrid(torch.arange(grid_size[0], device=device), torch.arange(grid_size[1], device=device),
                                indexing="ij")
    return torch.stack([rows.flatten(), cols.flatten()], dim=1).float()


def bucket_ids(coords: torch.Tensor, num_cls: int = 1, beta: float = BETA, alpha: float = ALPHA,
               gamma: float = GAMMA) -> torch.Tensor:
    """coords (N, 2) (row, col) of the patch tokens -> (T, T) long bucket of each (query, key) pair,
    T = num_cls + N; every pair with a cls token gets the extra bucket."""
    rel = coords[:, None, :] - coords[None, :, :]  # (N, N, 2): query minus key
    R, S = math.floor(beta), axis_size(beta)
    idx = piecewise_index(rel, alpha, beta, gamma) + R  # (N, N, 2) in [0, S)
    patch = idx[..., 0] * S + idx[..., 1]
    T = num_cls + coords.shape[0]
    out = torch.full((T, T), S * S, dtype=torch.long, device=coords.device)
    out[num_cls:, num_cls:] = patch
    return out


def bilinear_corners(rel: torch.Tensor, beta: float = BETA, alpha: float = ALPHA, gamma: float = GAMMA,
                     lookup: str = "project") -> tuple[torch.Tensor, torch.Tensor]:
    """Continuous offsets rel (..., 2) (row, col) -> 4 corner buckets (..., 4) long and their
    bilinear weights (..., 4), through g~ (differentiable in rel through the weights).

    project: the continuous index is clamped to the table's integer range [-floor(beta), floor(beta)]
    (g~ reaches beta itself, e.g. 3.8, beyond the last row); point (k, l) is the table's row/col.
    official: the point ((g~ / beta + 1) * S - 1) / 2 per axis, in [-0.5, S - 0.5] (F.grid_sample,
    align_corners=False), the row offset on the grid's column axis; a corner outside the grid has
    weight 0 (zero padding) and a clamped, unused bucket id."""
    if lookup not in COORD_LOOKUPS:
        raise ValueError(f"coordinate lookup must be one of {COORD_LOOKUPS}, got {lookup!r}")
    R, S = math.floor(beta), axis_size(beta)
    u = relaxed_index(rel, alpha, beta, gamma)  # (..., 2) in [-beta, beta]
    if lookup == "project":
        point = u.clamp(-R, R) + R  # (..., 2) (grid row, grid col) in [0, S-1]
        lo = point.detach().floor().clamp(max=S - 2)  # top-left corner; the last cell uses its left neighbour
    else:
        normalised = u.clamp(-beta, beta) / beta  # (..., 2) in [-1, 1], grid_sample's grid (x, y) = (row, col) offset
        point = (((normalised + 1) * S - 1) / 2).flip(-1)  # (..., 2) (grid row, grid col) in [-0.5, S-0.5]
        lo = point.detach().floor()  # in [-1, S-1]: corners may fall outside the grid
    w = point - lo  # (..., 2) in [0, 1], carries the gradient
    k, l = lo[..., 0].long(), lo[..., 1].long()
    wy, wx = w[..., 0], w[..., 1]
    weights = torch.stack([(1 - wy) * (1 - wx), (1 - wy) * wx, wy * (1 - wx), wy * wx], dim=-1)
    if lookup == "project":
        corners = torch.stack([k * S + l, k * S + l + 1, (k + 1) * S + l, (k + 1) * S + l + 1], dim=-1)
        return corners, weights
    grid_rows, grid_cols = torch.stack([k, k, k + 1, k + 1], dim=-1), torch.stack([l, l + 1, l, l + 1], dim=-1)
    inside = (grid_rows >= 0) & (grid_rows < S) & (grid_cols >= 0) & (grid_cols < S)  # (..., 4)
    corners = grid_rows.clamp(0, S - 1) * S + grid_cols.clamp(0, S - 1)
    return corners, torch.where(inside, weights, torch.zeros_like(weights))


# A per-call edit of one block's relative-position bias, given by the caller of the ViT's
# forward_tokens (the backbone passes it through untouched):
#   hook(rpe, q, scores, bias) -> bias
# rpe: the ContextualRPE module (its table, buckets, rel, num_cls, index_args); q (B, H, T, d);
# scores (B, H, T, buckets) = q . r_n / sqrt(d) for every table row n; bias (B, H, T, T) the looked-up
# score bias, returned edited.
BiasHook = Callable[["ContextualRPE", torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class ContextualRPE(torch.nn.Module):
    """iRPE, contextual mode on keys, product method: logit_ij += q_i . r_ij / sqrt(d), r_ij from a
    learnable table (buckets, Ht, d) initialised to 0, over a fixed grid of 1 cls + gh*gw tokens.
    Ht = 1 (shared_heads, the default: one table for all heads of the layer, as the iRPE/AdPE
    official configs' shared_head=True) or Ht = H (one table per head: H times the parameters).

    The product is taken once per bucket, (B, H, T, buckets), then gathered per pair (iRPE's
    lookup-after-product), so no (T, T, d) tensor is formed.

    Loading a state dict whose table has the other head layout (1 vs H) rebuilds the table in that
    layout, so an encoder fine-tunes from checkpoints of either kind (e.g. per-head runs made before
    shared tables became the default); load before the optimizer is built, as the entry points do."""

    def __init__(self, num_heads: int, head_dim: int, grid_size: tuple[int, int], num_cls: int = 1,
                 alpha: float = ALPHA, beta: float = BETA, gamma: float = GAMMA, shared_heads: bool = True):
        super().__init__()
        self.num_cls, self.index_args = num_cls, dict(alpha=alpha, beta=beta, gamma=gamma)
        self.num_heads, self.head_dim = num_heads, head_dim
        self.decay_table = False  # True: the table is weight-decayed (AdPE's official code); set by the objective
        self.table = torch.nn.Parameter(torch.zeros(num_buckets(beta), 1 if shared_heads else num_heads, head_dim))
        coords = grid_coords(grid_size)
        self.register_buffer("buckets", bucket_ids(coords, num_cls, beta, alpha, gamma), persistent=False)  # (T, T)
        self.register_buffer("rel", coords[:, None, :] - coords[None, :, :], persistent=False)  # (N, N, 2)

    @property
    def shared_heads(self) -> bool:
        return self.table.shape[1] == 1

    def set_shared_heads(self, shared: bool) -> None:
        """Rebuild the (zero-initialised) table with one row block for all heads or one per head;
        only before training (the values are reset), e.g. by an objective's option."""
        self.table = torch.nn.Parameter(self.table.new_zeros(self.table.shape[0], 1 if shared else self.num_heads,
                                                             self.head_dim))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        stored = state_dict.get(prefix + "table")
        if stored is not None and stored.shape != self.table.shape and stored.shape[1] in (1, self.num_heads):
            self.set_shared_heads(stored.shape[1] == 1)  # adopt the checkpoint's head layout
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def no_weight_decay(self) -> set[str]:
        return set() if self.decay_table else {"table"}

    def forward(self, q: torch.Tensor, hook: BiasHook | None = None) -> torch.Tensor:
        """q (B, H, T, d) -> additive score bias (B, H, T, T), edited by `hook` when given."""
        B, H, T, d = q.shape
        if T != self.buckets.shape[0]:
            raise ValueError(f"relative positions are set up for {self.buckets.shape[0]} tokens, got {T}")
        scale = d**-0.5
        table = self.table.to(q.dtype).expand(-1, H, -1)  # (buckets, H, d): a shared table serves every head
        qr = torch.einsum("bhtd,nhd->bhtn", q, table) * scale  # (B, H, T, buckets)
        bias = qr.gather(-1, self.buckets.expand(B, H, T, T))
        return bias if hook is None else hook(self, q, qr, bias)
