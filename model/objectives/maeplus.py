"""MAE+ and AdPE (AdPE: Adversarial Positional Embeddings for Pretraining Vision Transformers via MAE+,
Wang et al. 2023, arXiv:2303.07598, sections 3.2 and 4).

MAE+: each image arrives as k crops (data.train_transform multicrop: (B, k, C, s, s), s = the
encoder's img_size, 112 -> 7x7 patches at p=16). Per crop, a share `mask_ratio` of the tokens is
masked; the encoder sees all tokens, the masked ones replaced by a learnable mask token, with the
position embedding on every token; the decoder (MAE's, with all N tokens and no mask tokens of
its own) predicts normalized pixels; the loss averages over masked tokens. The global batch counts
images, not crops, so lr = blr x images / 256 treats the k crops of an image as one image.
The encoder's position table is the fixed sin-cos of its grid, so the same weights fine-tune at
224 with the 14x14 table (export drops nothing; `pos_embed` is rebuilt for the new grid).

AdPE (`adversary`): a perturbation shared by every masked token, maximising the loss:
  ape_embed  a in R^D added to the masked tokens' absolute position embedding
  ape_coord  (d_row, d_col) added to their coordinates before the sin-cos encoding
  rpe_embed  per block, a perturbation of the iRPE table (buckets x H x d) for masked query rows
  rpe_coord  per block, (d_row, d_col) added to the relative offsets of masked query rows
             (relaxed index g~ + bilinear table lookup: `coord_lookup` project, the paper's, or
             official, the official code's grid_sample, which visible rows then read at delta 0)
  fgsm       pixel-space baseline: x + eps * sign(grad_x L) on the input (one extra backward to x)
The RPE variants need `rpe true` (iRPE in every encoder and decoder block).
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field

import torch
from torch import nn

from model.constants import IMAGENET_STD, device_constant
from model.irpe import COORD_LOOKUPS, grid_coords
from model.mae_decoder import MAEDecoder
from model.objectives.adversary import NORMS, UPDATES, Adversaries, RPEPerturbation, coordinate_corners
from model.objectives.base import Objective, ObjectiveConfig, register_objective
from model.objectives.mae import check_decoder, masked_patch_loss
from model.objectives.masking import check_mask_ratio, random_masking
from model.objectives.patches import normalized_pixels, patchify
from model.pos_embed import sincos_2d_at
from model.vit import VisionTransformer

ADVERSARIES = ("none", "ape_embed", "ape_coord", "rpe_embed", "rpe_coord", "fgsm")
APE_MODES = ("add", "replace")


@dataclass
class MAEPlusConfig(ObjectiveConfig):
    mask_ratio: float = field(default=0.75, metadata={"range": "(0, 1)"})  # per crop
    norm_pix_loss: bool = True  # reconstruct per-patch normalised pixels (MAE's default)
    decoder_dim: int = field(default=512, metadata={"range": "[4, inf)"})  # MAE decoder width
    decoder_depth: int = field(default=8, metadata={"range": "[1, inf)"})  # MAE decoder blocks
    decoder_heads: int = field(default=16, metadata={"range": "[1, inf)"})  # MAE decoder attention heads
    rpe: bool = False  # iRPE (contextual, product, on keys) in every encoder and decoder block
    irpe_shared_heads: bool = True  # one iRPE table per layer shared by its heads (official shared_head=True); false: one per head (H x the table parameters)
    adversary: str = "none"  # none (MAE+) | ape_embed | ape_coord | rpe_embed | rpe_coord | fgsm
    adv_norm: str = "linf"  # linf | l2: the constraint set of the PGD projection
    adv_eps: float = field(default=20.0, metadata={"range": "(0, inf)"})  # radius (position units: patches for coordinates, embedding units otherwise)
    adv_lr_scale: float = field(default=1.0, metadata={"range": "[0, inf)"})  # PGD step = lr_t x this [project default]
    adv_update: str = "steepest"  # steepest (sign for linf, normalised for l2) | sign | normalised | adam (official code: Adam ascent, then projection)
    ape_mode: str = "add"  # ape_embed: add (mask token + perturbed position) | replace (official code: the adversary replaces the mask token; fixed positions)
    coord_lookup: str = "project"  # rpe_coord's table lookup: project (the paper's; visible rows integer) | official (the official code's grid_sample: axes swapped, align_corners=False, +-beta; visible rows too)
    decay_tokens: bool = False  # weight-decay cls_token, mask_token and the iRPE tables (official code: true; project: exempt like MAE's position tables)
    fgsm_eps: float = field(default=0.01, metadata={"range": "(0, 1]"})  # pixel-space l_inf radius on [0, 1] pixels (Table A.1: 0.001 / 0.01 / 0.1)

    def validate(self) -> None:
        if self.adversary not in ADVERSARIES:
            raise ValueError(f"maeplus.adversary must be one of {ADVERSARIES}, got {self.adversary!r}")
        if self.adversary.startswith("rpe") and not self.rpe:
            raise ValueError(f"maeplus.adversary {self.adversary} perturbs relative positions: set maeplus.rpe true")
        if self.adv_norm not in NORMS:
            raise ValueError(f"maeplus.adv_norm must be one of {NORMS}, got {self.adv_norm!r}")
        if self.adv_update not in UPDATES:
            raise ValueError(f"maeplus.adv_update must be one of {UPDATES}, got {self.adv_update!r}")
        if self.coord_lookup not in COORD_LOOKUPS:
            close = difflib.get_close_matches(self.coord_lookup, COORD_LOOKUPS, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"maeplus.coord_lookup must be one of {COORD_LOOKUPS}, got {self.coord_lookup!r}{hint}")
        if self.ape_mode not in APE_MODES:
            raise ValueError(f"maeplus.ape_mode must be one of {APE_MODES}, got {self.ape_mode!r}")
        check_decoder("maeplus", self.decoder_dim, self.decoder_heads)

    def encoder_overrides(self) -> dict:
        """Encoder constructor arguments this objective needs (pretrain.py applies them)."""
        return {"rpe": self.rpe}

    def check_fits(self, img_size: int, patch_size: int, depth: int, micro_batch: int) -> None:
        check_mask_ratio("maeplus.mask_ratio", self.mask_ratio, (img_size // patch_size) ** 2)  # per crop


@register_objective("maeplus", MAEPlusConfig)
class MAEPlusObjective(Objective):
    def __init__(self, encoder: VisionTransformer, cfg: MAEPlusConfig):
        cfg.validate()
        if cfg.rpe != encoder.rpe:
            raise ValueError(f"maeplus.rpe {cfg.rpe} but the encoder was built with rpe={encoder.rpe}: "
                             f"build it with the same setting (pretrain.py does)")
        super().__init__(encoder, cfg)
        pe = encoder.patch_embed
        self.patch_size = pe.patch_size
        D = encoder.embed_dim
        self.mask_token = nn.Parameter(torch.zeros(1, 1, D))
        nn.init.normal_(self.mask_token, std=0.02)
        self.decoder = MAEDecoder(pe.grid_size, pe.patch_size, pe.proj.in_channels, D, cfg.decoder_dim,
                                  cfg.decoder_depth, cfg.decoder_heads, attn_backend=encoder.blocks[0].attn.backend,
                                  rpe=cfg.rpe)
        # The decoder sees all N tokens, so its own mask token is never used: frozen, it stays out of
        # the optimizer and weight decay but stays in the state dict (older checkpoints load strictly).
        self.decoder.mask_token.requires_grad_(False)
        if self.replaces_mask_token:  # the adversary is the masked tokens' input: no learned mask token
            self.mask_token.requires_grad_(False)
        rpes = [b.attn.rpe for b in (*encoder.blocks, *self.decoder.decoder_blocks) if b.attn.rpe is not None]
        for rpe in rpes:  # before the adversaries, whose rpe_embed shapes follow the tables
            rpe.set_shared_heads(cfg.irpe_shared_heads)
            rpe.decay_table = cfg.decay_tokens
        self.register_buffer("coords", grid_coords(pe.grid_size), persistent=False)  # (N, 2) (row, col)
        self.adversaries = Adversaries(self._adversary_shapes(), cfg.adv_norm, cfg.adv_eps, cfg.adv_lr_scale,
                                       cfg.adv_update)

    @property
    def replaces_mask_token(self) -> bool:
        return self.cfg.adversary == "ape_embed" and self.cfg.ape_mode == "replace"

    def no_weight_decay(self) -> set[str]:
        return set() if self.cfg.decay_tokens else {"mask_token"}

    def decayed_names(self) -> set[str]:
        """Names decayed although a submodule exempts them (train.engine.optim): the encoder's cls_token
        under decay_tokens (the iRPE tables and mask_token follow the option directly)."""
        return {"encoder.cls_token"} if self.cfg.decay_tokens else set()

    def _adversary_shapes(self) -> dict[str, tuple[int, ...]]:
        kind = self.cfg.adversary
        if kind == "ape_embed":
            return {"ape": (self.encoder.embed_dim,)}
        if kind == "ape_coord":
            return {"ape": (2,)}
        if kind in ("rpe_embed", "rpe_coord"):
            shapes = {}
            for prefix, blocks in (("enc", self.encoder.blocks), ("dec", self.decoder.decoder_blocks)):
                for i, block in enumerate(blocks):
                    table = block.attn.rpe.table  # (buckets, H, d)
                    shapes[f"rpe_{prefix}{i}"] = tuple(table.shape) if kind == "rpe_embed" else (2,)
            return shapes
        return {}

    # --- the generic hooks the loop and checkpoints use --------------------------------------
    def after_optimizer_step(self, lr: float, batches: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """One PGD ascent step of the adversaries from the gradients of this step's backward."""
        self.adversaries.step(lr)
        return {}

    def get_extra_state(self) -> dict:
        return {"adversaries": self.adversaries.state_dict()}

    def set_extra_state(self, state: dict) -> None:
        self.adversaries.load_state_dict(state["adversaries"])

    # --- forward ----------------------------------------------------------------------------------
    def target(self, crops: torch.Tensor) -> torch.Tensor:
        t = patchify(crops.to(torch.promote_types(crops.dtype, torch.float32)), self.patch_size)
        return normalized_pixels(t) if self.cfg.norm_pix_loss else t

    def positions(self, masked: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """masked (B, N) bool -> (B, N, D) absolute position embedding, perturbed on masked tokens."""
        fixed = self.encoder.pos_embed[:, 1:].to(dtype)  # (1, N, D)
        kind = self.cfg.adversary
        if kind == "ape_embed" and self.replaces_mask_token:  # the adversary sits in the token instead
            return fixed.expand(masked.shape[0], -1, -1)
        if kind == "ape_embed":
            perturbed = fixed + self.adversaries.get("ape", masked.device, dtype)
        elif kind == "ape_coord":
            delta = self.adversaries.get("ape", masked.device, torch.float32)
            perturbed = sincos_2d_at(self.encoder.embed_dim, self.coords + delta)[None].to(dtype)
        else:
            return fixed.expand(masked.shape[0], -1, -1)
        return torch.where(masked[..., None], perturbed, fixed)

    def rpe_perturbations(self, masked: torch.Tensor, dtype: torch.dtype, prefix: str,
                          blocks: nn.ModuleList) -> list[RPEPerturbation] | None:
        """One bias hook per block of `blocks` (the `bias_hooks` of forward_tokens / decode; their
        adversaries are named rpe_<prefix><i>), or None without an RPE adversary."""
        kind = self.cfg.adversary
        if kind not in ("rpe_embed", "rpe_coord"):
            return None
        if kind == "rpe_coord":  # every block's shifted offsets in one pass: (depth, 2) deltas
            deltas = torch.stack([self.adversaries.get(f"rpe_{prefix}{i}", masked.device, torch.float32)
                                  for i in range(len(blocks))])
            lookup = self.cfg.coord_lookup  # official: visible rows too, at delta 0 (as the official code)
            return [RPEPerturbation(masked, corners=c, every_row=lookup == "official")
                    for c in coordinate_corners(blocks[0].attn.rpe, deltas, lookup, masked)]
        return [RPEPerturbation(masked, embed=self.adversaries.get(f"rpe_{prefix}{i}", masked.device, dtype))
                for i in range(len(blocks))]

    def reconstruct(self, crops: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
        """crops (M, C, s, s), masked (M, N) bool -> predictions (M, N, p*p*C)."""
        tokens = self.encoder.patch_embed(crops)  # (M, N, D)
        fill = (self.adversaries.get("ape", tokens.device, tokens.dtype) if self.replaces_mask_token
                else self.mask_token.to(tokens.dtype))  # (D,) or (1, 1, D)
        tokens = torch.where(masked[..., None], fill, tokens)
        x = self.encoder.add_cls_token(tokens + self.positions(masked, tokens.dtype))
        latent = self.encoder.forward_tokens(
            x, bias_hooks=self.rpe_perturbations(masked, x.dtype, "enc", self.encoder.blocks))
        return self.decoder.decode(self.decoder.decoder_embed(latent),
                                   self.rpe_perturbations(masked, x.dtype, "dec", self.decoder.decoder_blocks))

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        images = batch["image"]
        crops = images.flatten(0, 1) if images.ndim == 5 else images  # (B*k, C, s, s): crops as samples
        N = self.encoder.num_patches
        masking = random_masking(crops.shape[0], N, self.cfg.mask_ratio, crops.device)
        masked = masking.mask.bool()  # (M, N), 1 = masked
        target = self.target(crops)
        if self.cfg.adversary == "fgsm":
            crops = self.fgsm(crops, masked, target)
        loss = masked_patch_loss(self.reconstruct(crops, masked), target, masking.mask)
        return {"loss": loss, **self.adversaries.norms()}

    def fgsm(self, crops: torch.Tensor, masked: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Pixel-space FGSM (Table A.1): crops + eps * sign(grad of the MIM loss w.r.t. the input),
        eps on [0, 1] pixels, i.e. eps / std per channel in the normalised input. Only the input's
        gradient is taken (no parameter gradients accumulate); the target stays the clean crop."""
        with torch.enable_grad():
            probe = crops.detach().requires_grad_()
            loss = masked_patch_loss(self.reconstruct(probe, masked), target, masked.float())
            (grad,) = torch.autograd.grad(loss, probe)
        C = crops.shape[1]
        std = device_constant(IMAGENET_STD if C == 3 else (1.0,) * C, crops.device, crops.dtype)
        return (crops + self.cfg.fgsm_eps * grad.sign() / std[:, None, None]).detach()
