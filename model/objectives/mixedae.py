"""MixedAE (Mixed Autoencoder for Self-supervised Visual Representation Learning, Chen et al., CVPR 2023,
arXiv:2303.17152, section 3 and appendix B).

Per micro-batch of B images in groups of g = 1/r:
  mix on device (compose: B/g mixed images; full: B) -> encoder over every token of each mixed
  image, with segment embeddings added to every block's input and homologous attention (TopK or
  the exact same-source mask) in the chosen blocks -> two losses:
  - unmixing reconstruction: per (mixed image, source image) the MAE decoder sees that image's
    encoded tokens and the mask token at the other images' positions, and predicts normalized
    pixels there (encoder and decoder costs match MAE at mask ratio 1 - r);
  - homologous contrastive loss on projected patch tokens (model/objectives/homocon.py).
  L = recon_weight * L_recon + homocon_weight * L_HomoCon.

`mixing none` is the "without mixing" ablation: MAE masking at ratio 1 - r per image, segment
embeddings by the image's index in its group, HomoCon across the images of the local batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kernels import GLOBAL, AttentionMask, SegmentMask, TopKMask
from model.mae_decoder import MAEDecoder
from model.objectives.base import Objective, ObjectiveConfig, register_objective
from model.objectives.homocon import ProjectionHead, homologous_contrastive_loss
from model.objectives.mae import check_decoder, masked_patch_loss
from model.objectives.masking import gather_tokens, random_masking
from model.objectives.mixing import MODES, Mixing, make_mixing, mix_images
from model.objectives.patches import normalized_pixels, patchify, unpatchify
from model.pos_embed import sincos_segments
from model.vit import VisionTransformer


@dataclass
class MixedAEConfig(ObjectiveConfig):
    mix_ratio: float = field(default=0.25, metadata={"range": "(0, 0.5]"})  # r: each image's share of a mixed image; groups of g = 1/r images
    mixing: str = "compose"  # compose (one mixed image per group) | full (g per group) | none (ablation)
    cell_size: int = field(default=32, metadata={"range": "[1, inf)"})  # mixing cell side in pixels, a multiple of the patch size (2x2 patches at p=16)
    exact_counts: bool = False  # true: require exactly C/g cells per image; false: C//g or C//g + 1 (ViT-B at 224: 49 cells)
    attention: str = "topk"  # topk (homologous TopK) | masked (same-source only, Table A4a) | global (naive)
    topk: int = field(default=0, metadata={"range": "[0, inf)"})  # keys kept per query in TopK blocks; 0 = round(r * N) [project default]
    topk_per_source: bool = False  # K of each query = its own image's patch count (overrides topk)
    homologous_blocks: str = "all"  # blocks with topk/masked attention: all | comma-separated indices [project default: all]
    segment_embed: bool = True  # sin-cos of the source index, added to every block's input
    recon_weight: float = field(default=1.0, metadata={"range": "[0, inf)"})  # 0 = HomoCon only (Table A4b)
    homocon_weight: float = field(default=1.0, metadata={"range": "[0, inf)"})  # lambda [project default 1]; 0 = reconstruction only
    temperature: float = field(default=0.1, metadata={"range": "(0, inf)"})  # HomoCon tau [project default]
    proj_dim: int = field(default=256, metadata={"range": "[1, inf)"})  # projection head output [project default]
    proj_hidden_dim: int = field(default=0, metadata={"range": "[0, inf)"})  # projection head hidden width; 0 = the encoder width
    norm_pix_loss: bool = True  # reconstruct per-patch normalised pixels (MAE's default)
    decoder_dim: int = field(default=512, metadata={"range": "[4, inf)"})  # MAE decoder width
    decoder_depth: int = field(default=8, metadata={"range": "[1, inf)"})  # MAE decoder blocks
    decoder_heads: int = field(default=16, metadata={"range": "[1, inf)"})  # MAE decoder attention heads

    @property
    def group_size(self) -> int:
        return round(1 / self.mix_ratio)

    def validate(self) -> None:
        if abs(1 / self.mix_ratio - self.group_size) > 1e-6:  # in (0, 0.5]: its field's range
            raise ValueError(f"mixedae.mix_ratio must be 1/g for an integer g >= 2 (e.g. 0.25), got {self.mix_ratio}")
        if self.mixing not in (*MODES, "none"):
            raise ValueError(f"mixedae.mixing must be compose, full or none, got {self.mixing!r}")
        if self.attention not in ("topk", "masked", "global"):
            raise ValueError(f"mixedae.attention must be topk, masked or global, got {self.attention!r}")
        if self.mixing == "none" and self.attention != "global":
            raise ValueError("mixedae.mixing none encodes single images, where homologous attention has nothing to "
                             "select: set mixedae.attention global")
        if self.recon_weight == self.homocon_weight == 0:
            raise ValueError("mixedae.recon_weight and mixedae.homocon_weight may be 0, but not both 0: nothing would "
                             "be trained")
        check_decoder("mixedae", self.decoder_dim, self.decoder_heads)
        self.block_indices(depth=None)

    def block_indices(self, depth: int | None) -> list[int]:
        """Encoder blocks with homologous attention (checked against depth when given)."""
        if self.homologous_blocks.strip() == "all":
            return list(range(depth)) if depth is not None else []
        try:
            blocks = sorted({int(b) for b in self.homologous_blocks.split(",")})
        except ValueError:
            raise ValueError(f"mixedae.homologous_blocks must be 'all' or comma-separated block indices, "
                             f"got {self.homologous_blocks!r}") from None
        if depth is not None and (blocks[0] < 0 or blocks[-1] >= depth):
            raise ValueError(f"mixedae.homologous_blocks {blocks} must lie in 0..{depth - 1} for a {depth}-block encoder")
        return blocks

    def check_fits(self, img_size: int, patch_size: int, depth: int, micro_batch: int | None = None) -> None:
        """Cross-checks with the model and the per-rank micro-batch, raised as ValueError."""
        g = self.group_size
        if micro_batch is not None and micro_batch % g:
            raise ValueError(f"MixedAE mixes groups of g = 1/mix_ratio = {g} images, but the micro-batch per rank is "
                             f"{micro_batch}: set train_micro_batch_size_per_gpu in the ds_config to a multiple of {g}")
        self.block_indices(depth)
        if self.mixing == "none":
            return
        if self.cell_size % patch_size or img_size % self.cell_size:
            # the sizes that fit (multiples of the patch dividing the image into at least g cells), nearest 2 patches
            fits = [c for c in range(patch_size, img_size + 1, patch_size)
                    if not img_size % c and (img_size // c) ** 2 >= g]
            hint = (f"e.g. {min(fits, key=lambda c: abs(c - 2 * patch_size))}" if fits
                    else f"no size fits an image of {img_size} px: give another model.img_size")
            raise ValueError(f"mixedae.cell_size {self.cell_size} px must be a multiple of the patch size {patch_size} "
                             f"and divide the image size {img_size} ({hint})")
        cells = (img_size // self.cell_size) ** 2
        if cells < g or (self.exact_counts and cells % g):
            raise ValueError(f"{cells} mixing cells of {self.cell_size} px do not split into g = {g} equal shares: "
                             f"change mixedae.cell_size, or set mixedae.exact_counts false")
        N = (img_size // patch_size) ** 2
        if self.topk > N + 1:
            raise ValueError(f"mixedae.topk {self.topk} exceeds the {N + 1} tokens of a mixed image")


@register_objective("mixedae", MixedAEConfig)
class MixedAEObjective(Objective):
    def __init__(self, encoder: VisionTransformer, cfg: MixedAEConfig):
        cfg.validate()
        pe = encoder.patch_embed
        cfg.check_fits(pe.img_size, pe.patch_size, len(encoder.blocks))
        super().__init__(encoder, cfg)
        self.g = cfg.group_size
        self.patch_size = pe.patch_size
        self.cell = cfg.cell_size // pe.patch_size  # in patches
        self.homologous = set(cfg.block_indices(len(encoder.blocks)))
        N = encoder.num_patches
        self.topk = cfg.topk or int(cfg.mix_ratio * N + 0.5)  # round(r*N), halves up
        self.register_buffer("segment_table", sincos_segments(encoder.embed_dim, self.g), persistent=False)  # (g, D)
        self.decoder = None
        if cfg.recon_weight > 0:
            self.decoder = MAEDecoder(pe.grid_size, pe.patch_size, pe.proj.in_channels, encoder.embed_dim,
                                      cfg.decoder_dim, cfg.decoder_depth, cfg.decoder_heads,
                                      attn_backend=encoder.blocks[0].attn.backend)
        self.projector = None
        if cfg.homocon_weight > 0:
            self.projector = ProjectionHead(encoder.embed_dim, cfg.proj_hidden_dim or encoder.embed_dim, cfg.proj_dim)

    # --- pieces ---------------------------------------------------------------------------------
    def draw_mixing(self, batch_size: int, device: torch.device, generator: torch.Generator | None = None) -> Mixing:
        return make_mixing(batch_size, self.encoder.patch_embed.grid_size, self.cell, self.g, self.cfg.mixing,
                           self.cfg.exact_counts, device, generator)

    def target(self, images: torch.Tensor) -> torch.Tensor:
        t = patchify(images.to(torch.promote_types(images.dtype, torch.float32)), self.patch_size)  # (B, N, p*p*C), fp32 in bf16/fp16 runs
        return normalized_pixels(t) if self.cfg.norm_pix_loss else t

    def segment_input(self, segments: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """segments (B, T) with GLOBAL for cls -> (B, T, D) embeddings added to every block's input."""
        if not self.cfg.segment_embed:
            return None
        emb = self.segment_table[segments.clamp_min(0)]  # (B, T, D)
        return emb.masked_fill((segments == GLOBAL)[..., None], 0.0).to(dtype)  # cls gets none

    def attention_masks(self, segments: torch.Tensor) -> list[AttentionMask | None]:
        """segments (Bm, 1+N), GLOBAL at cls -> one per-call attention restriction per encoder block."""
        if self.cfg.attention == "global":
            return [None] * len(self.encoder.blocks)
        k: int | torch.Tensor = self.topk
        if self.cfg.topk_per_source:  # each query keeps as many keys as its own image has patches
            counts = torch.nn.functional.one_hot(segments[:, 1:], self.g).sum(dim=1)  # (Bm, g)
            k = counts.gather(1, segments.clamp_min(0))  # (Bm, 1+N); the cls row is global anyway
        masks: list[AttentionMask | None] = []
        for i in range(len(self.encoder.blocks)):
            if i not in self.homologous:
                masks.append(None)
            elif self.cfg.attention == "masked":
                masks.append(SegmentMask(segments))
            else:
                masks.append(TopKMask(k, num_global=1, segments=segments))
        return masks

    def encode_mixed(self, mixed: torch.Tensor, segment: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """mixed (Bm, C, H, W), segment (Bm, N) -> latent (Bm, 1+N, D) and TopK sampling accuracies."""
        x = self.encoder.add_cls_token(self.encoder.embed_patches(mixed))  # (Bm, 1+N, D)
        segments = torch.cat([torch.full_like(segment[:, :1], GLOBAL), segment], dim=1)  # (Bm, 1+N)
        masks = self.attention_masks(segments)
        latent = self.encoder.forward_tokens(x, self.segment_input(segments, x.dtype), masks)
        recorded = {i: m.same_source_share for i, m in enumerate(masks)
                    if isinstance(m, TopKMask) and m.same_source_share is not None}
        if not recorded:
            return latent, {}
        # One copy of all blocks' shares: a compiled block returns its share as a graph output, which
        # a CUDA graph's next replay overwrites before the loop reads its log window.
        shares = torch.stack(list(recorded.values()))  # (blocks,)
        stats = {f"topk_acc_block{i}": share for i, share in zip(recorded, shares.unbind())}
        return latent, stats | {"topk_acc": shares.mean()}

    def unmix_predictions(self, latent: torch.Tensor, mixing: Mixing) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One decoding per (mixed image, source image): pred (Bm, g, N, P), the decoder's kept
        positions keep (Bm, g, N) bool, and the batch index of each decoding's source (Bm, g)."""
        seg_ids = torch.arange(self.g, device=latent.device)
        keep = mixing.segment[:, None, :] == seg_ids[None, :, None]  # (Bm, g, N)
        return self.decoder.forward_keep(latent, keep), keep, mixing.source_of(seg_ids[None, :])

    def homocon(self, tokens: torch.Tensor, labels: torch.Tensor, sets: int = 1) -> torch.Tensor:
        """tokens (B', L, D) encoder patch outputs, labels (B', L) -> the contrastive loss, each of
        `sets` consecutive slices of B' / sets rows contrasted among itself."""
        z = self.projector(tokens)  # (B', L, proj_dim), fp32, unit norm
        return homologous_contrastive_loss(z.reshape(sets, -1, z.shape[-1]), labels.reshape(sets, -1),
                                           self.cfg.temperature)

    # --- forward ----------------------------------------------------------------------------------
    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        images = batch["image"]
        if self.cfg.mixing == "none":
            return self.forward_unmixed(images)
        return self.forward_mixed(images, self.draw_mixing(images.shape[0], images.device))

    def forward_mixed(self, images: torch.Tensor, mixing: Mixing) -> dict[str, torch.Tensor]:
        mixed = mix_images(images, mixing, self.patch_size)  # (Bm, C, H, W)
        latent, out = self.encode_mixed(mixed, mixing.segment)
        loss = latent.new_zeros((), dtype=torch.float32)
        if self.decoder is not None:
            pred, keep, source = self.unmix_predictions(latent, mixing)
            target = self.target(images)[source]  # (Bm, g, N, P)
            out["loss_recon"] = masked_patch_loss(pred.flatten(0, 1), target.flatten(0, 1), (~keep).flatten(0, 1).float())
            loss = loss + self.cfg.recon_weight * out["loss_recon"]
        if self.projector is not None:
            labels = torch.arange(len(mixed), device=images.device)[:, None] * self.g + mixing.segment  # (Bm, N)
            out["loss_homocon"] = self.homocon(latent[:, 1:], labels)
            loss = loss + self.cfg.homocon_weight * out["loss_homocon"]
        return {"loss": loss, **out}

    def forward_unmixed(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        """The 'without mixing' ablation: MAE on each image + segment embeddings + HomoCon across the
        images of each group of g."""
        B = images.shape[0]
        if B % self.g:
            raise ValueError(f"the micro-batch of {B} images does not split into groups of g = {self.g}")
        masking = random_masking(B, self.encoder.num_patches, 1 - self.cfg.mix_ratio, images.device)
        kept = gather_tokens(self.encoder.embed_patches(images), masking.ids_keep)  # (B, L, D)
        x = self.encoder.add_cls_token(kept)
        index = torch.arange(B, device=images.device)
        segments = torch.cat([torch.full((B, 1), GLOBAL, device=images.device),
                              (index % self.g)[:, None].expand(-1, kept.shape[1])], dim=1)  # (B, 1+L)
        latent = self.encoder.forward_tokens(x, self.segment_input(segments, x.dtype))
        out: dict[str, torch.Tensor] = {}
        loss = latent.new_zeros((), dtype=torch.float32)
        if self.decoder is not None:
            pred = self.decoder(latent, masking.ids_restore)
            out["loss_recon"] = masked_patch_loss(pred, self.target(images), masking.mask)
            loss = loss + self.cfg.recon_weight * out["loss_recon"]
        if self.projector is not None:  # Eq. 7 across the images of each group of g (appendix C), as in a mixed image
            out["loss_homocon"] = self.homocon(latent[:, 1:], index[:, None].expand(-1, kept.shape[1]), B // self.g)
            loss = loss + self.cfg.homocon_weight * out["loss_homocon"]
        return {"loss": loss, **out}

    @torch.no_grad()
    def visualizations(self, images: torch.Tensor, noise: torch.Tensor) -> dict[str, list[torch.Tensor]]:
        """Rows per source image (the first multiple of g images): original, the mixed image it sits
        in, the decoder's view (its own cells, others blank), the reconstruction with its own cells
        pasted. A fixed mixing (seed 0) keeps figures comparable across steps."""
        n = images.shape[0] // self.g * self.g
        if self.cfg.mixing == "none" or self.decoder is None or n == 0:
            return {}
        images = images[:n]
        mixing = self.draw_mixing(n, torch.device("cpu"), torch.Generator().manual_seed(0))
        mixing = Mixing(mixing.source.to(images.device), mixing.segment.to(images.device), mixing.group_size,
                        mixing.per_group)
        mixed = mix_images(images, mixing, self.patch_size)
        latent, _ = self.encode_mixed(mixed, mixing.segment)
        pred, keep, _ = self.unmix_predictions(latent, mixing)  # (Bm, g, N, P)
        index = torch.arange(n, device=images.device)
        m, s = (index // self.g) * mixing.per_group, index % self.g  # each image's first mixed image
        pred, own = pred[m, s].float(), keep[m, s][..., None].float()  # (n, N, P), (n, N, 1)
        target = patchify(images.float(), self.patch_size)
        if self.cfg.norm_pix_loss:
            pred = pred * (target.var(-1, keepdim=True) + 1e-6) ** 0.5 + target.mean(-1, keepdim=True)
        shape = (self.patch_size, self.encoder.patch_embed.grid_size, images.shape[1])
        return {"mixedae_unmixing": [
            images.float(),
            mixed[m].float(),
            unpatchify(target * own, *shape),
            unpatchify(target * own + pred * (1 - own), *shape),
        ]}
