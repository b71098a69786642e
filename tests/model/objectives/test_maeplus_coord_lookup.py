"""`maeplus.coord_lookup`: rpe_coord's bilinear lookup of shifted relative positions, against a
reference written here from the definitions, one pair at a time:

  project   the paper's (AdPE, arXiv:2303.07598, section 4.2.3): k = floor(g~(row offset + d_row)),
            l = floor(g~(col offset + d_col)), weights w = g~ - k, the dictionary p[k, l] at integer
            k, l in -R..R (R = floor(beta)), the index clamped to that range; visible rows read iRPE's
            integer g
  official  the official code's (maple-research-lab/AdPE, position_embed/irpe_adv_coord.py,
            adv_type 2): g~ clamped to +-beta, divided by beta, F.grid_sample of the S x S bucket grid
            (bilinear, align_corners=False, zero padding) with grid x = the row offset; visible rows
            read the same at shift 0

The official reference is itself checked against F.grid_sample called as the official code calls
it. The lookup (corner buckets and weights, and their gradient in the shift), each block's whole
relative-position bias and the whole model's loss are checked against the reference for both
options; `test_the_measured_gaps` prints the differences docs/methods/MAEPLUS_ADPE.md quotes
(python -m pytest -s tests/model/objectives/test_maeplus_coord_lookup.py -k measured_gaps)."""
import functools
import math

import pytest
import torch
import torch.nn.functional as F

from model import create_model
from model.irpe import bilinear_corners, grid_coords
from model.objectives import build_objective
from model.objectives.maeplus import MAEPlusConfig

ALPHA, BETA, GAMMA = 1.9, 3.8, 15.2
R, S = 3, 7  # floor(beta); grid points per axis
CLS = S * S  # the bucket of every pair with the cls token
GRID = [(r, c) for r in range(7) for c in range(7)]  # the 7x7 patch grid of a 28 px crop at patch 4, row-major
DELTAS = [(0.0, 0.0), (0.4, -1.3), (-3.3, 2.2), (7.5, -12.0), (-20.0, 20.0)]  # (d_row, d_col)


# --- the reference ---------------------------------------------------------------------------------
def relaxed(x: float) -> float:
    """g~ (the paper's relaxed index)."""
    if abs(x) <= ALPHA:
        return x
    return math.copysign(min(BETA, ALPHA + math.log(abs(x) / ALPHA) / math.log(GAMMA / ALPHA) * (BETA - ALPHA)), x)


def integer(x: float) -> int:
    """g (iRPE's index: rounded, clipped at beta, truncated)."""
    if abs(x) <= ALPHA:
        return round(x)
    far = ALPHA + math.log(abs(x) / ALPHA) / math.log(GAMMA / ALPHA) * (BETA - ALPHA)
    return int(math.copysign(min(BETA, round(far)), x))


def pair_weights(row_offset: float, col_offset: float, lookup: str) -> dict[int, float]:
    """{bucket: weight} of one shifted offset."""
    u_row, u_col = relaxed(row_offset), relaxed(col_offset)
    out: dict[int, float] = {}
    if lookup == "project":
        u_row, u_col = min(max(u_row, -R), R), min(max(u_col, -R), R)
        k, l = min(math.floor(u_row), R - 1), min(math.floor(u_col), R - 1)  # at +R: the last cell, weight 1
        w_row, w_col = u_row - k, u_col - l
        for kk, ll, w in ((k, l, (1 - w_row) * (1 - w_col)), (k, l + 1, (1 - w_row) * w_col),
                          (k + 1, l, w_row * (1 - w_col)), (k + 1, l + 1, w_row * w_col)):
            out[(kk + R) * S + (ll + R)] = out.get((kk + R) * S + (ll + R), 0.0) + w
        return out
    # official: grid_sample's x runs along the grid's columns and takes the row offset
    x = ((min(max(u_row, -BETA), BETA) / BETA + 1) * S - 1) / 2
    y = ((min(max(u_col, -BETA), BETA) / BETA + 1) * S - 1) / 2
    for yy in (math.floor(y), math.floor(y) + 1):
        for xx in (math.floor(x), math.floor(x) + 1):
            if 0 <= yy < S and 0 <= xx < S:  # zero padding outside the grid
                out[yy * S + xx] = out.get(yy * S + xx, 0.0) + (1 - abs(x - xx)) * (1 - abs(y - yy))
    return out


@functools.lru_cache(maxsize=None)
def lookup_matrix(delta: tuple[float, float], lookup: str) -> torch.Tensor:
    """(N, N, buckets) float64: row (i, j) holds the weights of query i's lookup for key j (read only)."""
    out = [[[0.0] * (CLS + 1) for _ in GRID] for _ in GRID]
    for i, (ri, ci) in enumerate(GRID):
        for j, (rj, cj) in enumerate(GRID):
            for bucket, w in pair_weights(ri - rj + delta[0], ci - cj + delta[1], lookup).items():
                out[i][j][bucket] += w
    return torch.tensor(out, dtype=torch.float64)


@functools.lru_cache(maxsize=None)
def integer_matrix() -> torch.Tensor:
    """(N, N, buckets): iRPE's integer lookup, one-hot (read only)."""
    out = [[[0.0] * (CLS + 1) for _ in GRID] for _ in GRID]
    for i, (ri, ci) in enumerate(GRID):
        for j, (rj, cj) in enumerate(GRID):
            out[i][j][(integer(ri - rj) + R) * S + (integer(ci - cj) + R)] = 1.0
    return torch.tensor(out, dtype=torch.float64)


def reference_bias(table: torch.Tensor, q: torch.Tensor, masked: torch.Tensor, delta: tuple[float, float],
                   lookup: str) -> torch.Tensor:
    """logit_ij += q_i . r_ij / sqrt(d): table (buckets, 1 or H, d), q (B, H, T, d), masked (B, N) ->
    (B, H, T, T), r_ij the shifted lookup for masked query rows, the visible rows' own otherwise, the
    cls bucket for every pair with the cls token."""
    B, H, T, d = q.shape
    shifted = lookup_matrix(delta, lookup)
    visible = integer_matrix() if lookup == "project" else lookup_matrix((0.0, 0.0), "official")
    weights = torch.zeros(B, T, T, CLS + 1, dtype=torch.float64)
    weights[:, 0, :, CLS] = 1.0
    weights[:, :, 0, CLS] = 1.0
    for b in range(B):
        for i in range(T - 1):
            weights[b, 1 + i, 1:] = shifted[i] if masked[b, i] else visible[i]
    r = torch.einsum("btsn,nhd->bhtsd", weights, table.double().expand(-1, H, -1))  # r_ij per head
    return torch.einsum("bhtd,bhtsd->bhts", q.double(), r) / math.sqrt(d)


# --- the code under test -----------------------------------------------------------------------------
def _objective(lookup: str, seed: int = 0):
    torch.manual_seed(seed)
    enc = create_model("vit_debug_patch4", rpe=True)  # 28 px, patch 4: a 7x7 grid, 2 blocks of 2 heads
    cfg = MAEPlusConfig(decoder_dim=32, decoder_depth=1, decoder_heads=2, rpe=True, adversary="rpe_coord",
                        coord_lookup=lookup)
    obj = build_objective("maeplus", enc, cfg)
    for module in obj.modules():
        if hasattr(module, "table"):  # tables start at 0; give them values so relative positions matter
            torch.nn.init.normal_(module.table, std=0.5)
    for i, name in enumerate(obj.adversaries.tensors):  # a different shift per block
        obj.adversaries.tensors[name] = torch.tensor(DELTAS[1 + i % 4]).requires_grad_()
    return obj.double()


def _blocks(obj):
    return [("enc", i, b) for i, b in enumerate(obj.encoder.blocks)] + \
           [("dec", i, b) for i, b in enumerate(obj.decoder.decoder_blocks)]


def _code_matrix(delta: tuple[float, float], lookup: str) -> torch.Tensor:
    rel = (grid_coords((7, 7))[:, None] - grid_coords((7, 7))[None]).double() + torch.tensor(delta, dtype=torch.float64)
    corners, weights = bilinear_corners(rel, lookup=lookup)  # (N, N, 4) each
    return torch.zeros(49, 49, CLS + 1, dtype=torch.float64).scatter_add_(-1, corners, weights)


def _masked(B: int = 2) -> torch.Tensor:
    masked = torch.rand(B, 49, generator=torch.Generator().manual_seed(3)) < 0.75
    masked[:, 0], masked[:, 1] = True, False  # both kinds of rows in every sample
    return masked


def _loss(obj, images, reference: bool = False):
    if reference:  # every block's bias from the reference, through the same model
        def hooks(masked, dtype, prefix, blocks):
            def hook_for(i):
                delta = tuple(obj.adversaries.tensors[f"rpe_{prefix}{i}"].tolist())
                return lambda rpe, q, qr, bias: reference_bias(rpe.table, q, masked, delta, obj.cfg.coord_lookup)
            return [hook_for(i) for i in range(len(blocks))]
        obj.rpe_perturbations = hooks
    torch.manual_seed(5)  # the same masking every call
    return obj({"image": images})["loss"]


IMAGES = torch.randn(2, 2, 3, 28, 28, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


# --- tests ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("lookup", ["project", "official"])
def test_the_lookup_of_shifted_offsets_is_the_reference(lookup):
    for delta in DELTAS:
        torch.testing.assert_close(_code_matrix(delta, lookup), lookup_matrix(delta, lookup), rtol=0, atol=1e-12,
                                   msg=f"{lookup} at {delta}")


def test_the_official_reference_is_grid_sample_as_the_official_code_calls_it():
    """The official code's own call, on a table whose (S, S) grid is the bucket grid: grid_sample of
    g~ / beta with the (row, col) offsets as the grid's (x, y), bilinear, align_corners=False, zero padding."""
    table = torch.randn(CLS + 1, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    image = table[:CLS].T.reshape(1, 5, S, S)  # (1, C, S, S): bucket k * S + l at grid row k, column l
    for delta in DELTAS:
        grid = torch.tensor([[[relaxed(ri - rj + delta[0]) / BETA, relaxed(ci - cj + delta[1]) / BETA]
                              for (rj, cj) in GRID] for (ri, ci) in GRID], dtype=torch.float64)  # (N, N, 2)
        sampled = F.grid_sample(image, grid[None], mode="bilinear", padding_mode="zeros", align_corners=False)
        torch.testing.assert_close(torch.einsum("ijn,nc->ijc", lookup_matrix(delta, "official"), table),
                                   sampled[0].permute(1, 2, 0), rtol=0, atol=1e-12, msg=str(delta))


@pytest.mark.parametrize("lookup", ["project", "official"])
def test_the_lookups_gradient_in_the_shift_is_the_references(lookup):
    """d/d delta of a fixed mix of the looked-up weights: autograd against central differences of the reference."""
    mix = torch.randn(49, 49, CLS + 1, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    delta = torch.tensor([0.4, -1.3], dtype=torch.float64, requires_grad=True)
    rel = (grid_coords((7, 7))[:, None] - grid_coords((7, 7))[None]).double() + delta
    corners, weights = bilinear_corners(rel, lookup=lookup)
    (grad,) = torch.autograd.grad((mix.gather(-1, corners) * weights).sum(), delta)
    h = 1e-6
    numeric = [((lookup_matrix((0.4 + h * (a == 0), -1.3 + h * (a == 1)), lookup)
                 - lookup_matrix((0.4 - h * (a == 0), -1.3 - h * (a == 1)), lookup)) * mix).sum() / (2 * h)
               for a in (0, 1)]
    torch.testing.assert_close(grad, torch.stack(numeric), rtol=1e-6, atol=1e-6)
    assert grad.abs().min() > 0


@pytest.mark.parametrize("lookup", ["project", "official"])
def test_each_blocks_whole_bias_is_the_reference(lookup):
    """The bias the objective's hooks give every encoder and decoder block: cls row and column,
    masked rows through the shifted lookup, visible rows through theirs."""
    obj = _objective(lookup)
    masked = _masked()
    for prefix, i, block in _blocks(obj):
        rpe = block.attn.rpe
        hooks = obj.rpe_perturbations(masked, torch.float64, prefix, obj.encoder.blocks if prefix == "enc"
                                      else obj.decoder.decoder_blocks)
        q = torch.randn(2, block.attn.num_heads, 50, rpe.head_dim, dtype=torch.float64)
        delta = tuple(obj.adversaries.tensors[f"rpe_{prefix}{i}"].tolist())
        torch.testing.assert_close(rpe(q, hooks[i]), reference_bias(rpe.table.detach(), q, masked, delta, lookup),
                                   rtol=0, atol=1e-12, msg=f"{lookup} {prefix}{i}")


@pytest.mark.parametrize("lookup", ["project", "official"])
def test_the_whole_models_loss_is_the_reference_models(lookup):
    obj = _objective(lookup)
    loss, reference = _loss(obj, IMAGES), _loss(obj, IMAGES, reference=True)
    assert abs(loss.item() - reference.item()) < 1e-12


@pytest.mark.parametrize("lookup", ["project", "official"])
def test_the_shifts_get_their_gradient_and_a_pgd_step_raises_the_loss(lookup):
    obj = _objective(lookup)
    before = _loss(obj, IMAGES)
    before.backward()
    assert all(t.grad.abs().min() > 0 for t in obj.adversaries.tensors.values())  # every block's shift, both axes
    obj.after_optimizer_step(1e-3, [{"image": IMAGES}])
    assert _loss(obj, IMAGES).item() > before.item()


def test_at_shift_zero_official_masked_rows_are_its_visible_rows_and_project_ones_keep_the_integer_rows_near():
    """official reads every patch row one way, so a zero shift changes nothing; project's masked
    rows read the integer rows exactly where g~ = g (offsets within alpha on both axes)."""
    official = lookup_matrix((0.0, 0.0), "official")
    assert torch.equal(_code_matrix((0.0, 0.0), "official"), official)
    project, whole = _code_matrix((0.0, 0.0), "project"), integer_matrix()
    near = torch.tensor([[max(abs(ri - rj), abs(ci - cj)) <= ALPHA for (rj, cj) in GRID] for (ri, ci) in GRID])
    torch.testing.assert_close(project[near], whole[near], rtol=0, atol=1e-12)
    assert (project[~near] - whole[~near]).abs().max() > 0.01
    assert (official - whole).abs().max() > 0.5  # the official lookup is not iRPE's at integer offsets


def test_the_measured_gaps(record_property):
    """The numbers of the method page: between the options (looked-up rows of an N(0, 1) table at the
    shifts DELTAS; the first encoder block's bias; the whole model's loss, iRPE tables N(0, 0.5^2),
    per-block shifts DELTAS[1:4], 2 images x 2 crops of 28 px, float64) and each option against the reference."""
    table = torch.randn(CLS + 1, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    lookup_gap = max(torch.einsum("ijn,nd->ijd", _code_matrix(d, "official") - _code_matrix(d, "project"),
                                  table).abs().max().item() for d in DELTAS)
    q = torch.randn(2, 2, 50, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    masked = _masked()
    rows = torch.cat([torch.zeros(2, 1, dtype=torch.bool), masked], 1)  # (B, T) masked query rows
    obj = {lookup: _objective(lookup) for lookup in ("project", "official")}  # the same weights, tables, shifts
    rpe = {lookup: o.encoder.blocks[0].attn.rpe for lookup, o in obj.items()}
    bias = {lookup: rpe[lookup](q, o.rpe_perturbations(masked, torch.float64, "enc", o.encoder.blocks)[0])
            for lookup, o in obj.items()}
    gap = (bias["official"] - bias["project"]).transpose(1, 2)  # (B, T, H, T)
    loss = {lookup: _loss(o, IMAGES).item() for lookup, o in obj.items()}
    versus_reference = {lookup: (
        max((_code_matrix(d, lookup) - lookup_matrix(d, lookup)).abs().max().item() for d in DELTAS),
        (bias[lookup] - reference_bias(rpe[lookup].table.detach(), q, masked,
                                       tuple(obj[lookup].adversaries.tensors["rpe_enc0"].tolist()),  # fp32 values
                                       lookup)).abs().max().item(),
        abs(loss[lookup] - _loss(obj[lookup], IMAGES, reference=True).item())) for lookup in obj}
    measured = {"official - project, looked-up rows": lookup_gap,
                "official - project, block enc0's bias on masked rows": gap[rows].abs().max().item(),
                "official - project, block enc0's bias on visible rows": gap[~rows].abs().max().item(),
                "loss, project": loss["project"], "loss, official": loss["official"],
                "official - project, loss": abs(loss["official"] - loss["project"]),
                **{f"{lookup} - reference (lookup, bias, loss)": v for lookup, v in versus_reference.items()}}
    record_property("coord_lookup_gaps", repr(measured))
    print("\n" + "\n".join(f"{k}: " + (", ".join(f"{x:.3g}" for x in v) if isinstance(v, tuple) else f"{v:.5g}")
                            for k, v in measured.items()))
    assert all(max(v) < 1e-12 for v in versus_reference.values())
    assert lookup_gap > 0.5 and gap[rows].abs().max() > 0.1 and loss["official"] != loss["project"]
    assert gap[~rows].abs().max() > 0.1  # official visible rows read the continuous lookup too


def test_a_misspelt_lookup_is_refused_with_the_closest_name():
    with pytest.raises(ValueError, match="coord_lookup must be one of .*did you mean 'official'"):
        MAEPlusConfig(rpe=True, adversary="rpe_coord", coord_lookup="oficial").validate()
    with pytest.raises(ValueError, match="coordinate lookup must be one of"):
        bilinear_corners(torch.zeros(1, 2), lookup="grid_sample")
