"""MLO-MAE: a masking network learned by three-level optimisation (Downstream Task Guided Masking
Learning in Masked Autoencoders Using Multi-Level Optimization, Guo et al. 2024, arXiv:2402.18128).

Level I (this module's forward, trained by the engine like any objective): the masking
network T reads the encoder's patch embeddings (+ position) of all N patches, flattened:
    p = sigmoid(Linear(512, N)(ReLU(Linear(N*D, 512)(tokens))))            (B, N)
masks the N*ratio patches with the highest p (hard top-k; ties by patch order) and trains the
encoder E and MAE decoder D on the p-weighted reconstruction loss
    L1 = sum_j m_j p_j l_j / sum_j m_j          (l_j: per-patch MSE, m_j = 1 for masked patches)
which is the only path from the loss to T. With `straight_through` the top-k is read as the
identity in the backward pass: the weights are m_j + p_j - sg(p_j), so E and D see the plain
MAE loss on the learned mask and T receives l_j for every patch.
T's input is taken as data (computed from E without a gradient), as in Eq. 1 where sigma
depends on (X, T) only; with `mask_input_grad` (the released code's behaviour) the level-I loss
also reaches the patch embedding through T's input (T's weights still get no level-I gradient),
and the level-III finite differences recompute T's input at the perturbed encoder.

Levels II and III run in `after_optimizer_step` (the loop's generic hook, which hands over the
step's micro-batches), outside the engine: the linear head C (on the frozen encoder's cls feature)
and T are fp32 modules replicated on every rank, with their own AdamW, gradients all-reduced, lrs
following the encoder's schedule times `head_lr_scale` / `mask_lr_scale`. Every `level1_steps`
optimizer steps, C takes `level2_steps` steps on the latest D_tr batches (which may span steps;
with `level2_batch` own, only those from before the last level-I step, so levels II/III never read
the micro-batches level I just stepped on, as the released code's separate level-II loader; its
first cycle, with nothing held back yet, runs neither level II nor III);
every `mask_every`-th such cycle T takes one step along the hypergradient of the validation loss
(model/objectives/hypergrad.py), whose passes run in fp32 with TF32 off: the finite-difference
perturbation (||eps v|| = 0.01 over all encoder weights) is far below bf16 / fp16 / TF32 resolution.

Batches carry the level-I/II data (`image`, `label`: D_tr) and, on the micro-batch that closes a
mask cycle, `val_image` / `val_label` (D_val); data/split.py builds that stream.

Variant `blo` (BLO-MAE, Eq. 5): E is trained on gamma * L1 + CE(C(E(x)), y) (C held fixed in that
step, then stepped on level II), and T's hypergradient is -eta_E * gamma * H_{T,E}(L1) v_E (T does
not reach C in the lower level, so there is no head path).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from model.adamw_state import load_fused, with_state
from model.objectives.base import ObjectiveConfig, register_objective
from model.objectives.hypergrad import Points, call_with, full_fp32, mask_hypergradient
from model.objectives.mae import MAEObjective, check_decoder, per_patch_mse
from model.objectives.masking import Masking, check_mask_ratio
from model.objectives.masking_net import (
    MaskingNetwork,
    mask_statistics,
    top_masking,
    weighted_recon_loss,
)
from model.objectives.patches import unpatchify
from model.vit import VisionTransformer

VARIANTS = ("mlo", "blo")


@dataclass
class MLOMAEConfig(ObjectiveConfig):
    mask_ratio: float = field(default=0.75, metadata={"range": "(0, 1)"})  # share of patches T masks, in (0, 1)
    norm_pix_loss: bool = True  # reconstruct per-patch normalised pixels (MAE's default)
    decoder_dim: int = field(default=512, metadata={"range": "[4, inf)"})  # MAE decoder width
    decoder_depth: int = field(default=8, metadata={"range": "[1, inf)"})  # MAE decoder blocks
    decoder_heads: int = field(default=16, metadata={"range": "[1, inf)"})  # MAE decoder attention heads
    mask_hidden: int = field(default=512, metadata={"range": "[1, inf)"})  # masking network: Linear(N*D, hidden) -> ReLU -> Linear(hidden, N) -> sigmoid
    straight_through: bool = False  # top-k as identity in the backward (Appendix A.4)
    num_classes: int = field(default=1000, metadata={"range": "[2, inf)"})  # classes of the labeled shards (levels II and III)
    head_lr_scale: float = field(default=0.4, metadata={"range": "[0, inf)"})  # lr of C / lr of E (paper: 4e-5 / 1e-4 ImageNet, 1e-3 / 1e-3 CIFAR)
    mask_lr_scale: float = field(default=0.4, metadata={"range": "[0, inf)"})  # lr of T / lr of E
    aux_weight_decay: float = field(default=0.05, metadata={"range": "[0, inf)"})  # AdamW weight decay of C and T (weights only, unless aux_decay_biases)
    aux_decay_biases: bool = False  # decay C's and T's biases too (released code: torch AdamW over all their parameters)
    level1_steps: int = field(default=1, metadata={"range": "[1, inf)"})  # encoder/decoder steps per head step (unroll steps: 1 ImageNet, 2 CIFAR)
    level2_steps: int = field(default=1, metadata={"range": "[1, inf)"})  # head steps per cycle, on the cycle's latest D_tr micro-batches
    mask_every: int = field(default=1, metadata={"range": "[1, inf)"})  # cycles per masking-network step (Table 16)
    through_head: bool = True  # keep Eq. 9's path dL3/dC' dC'/dE' (False: through E' only)
    unroll_lr: str = "schedule"  # eta_E, eta_C of Eqs. 6-7: schedule (the current lrs, Appendix A) | unit (1, as Betty's FD in the released code)
    mask_adam_eps: float = field(default=1e-16, metadata={"range": "(0, inf)"})  # AdamW eps of T [project default]: with eta_E ~ 1e-4 its gradients sit far below 1e-8
    fd_eps: float = field(default=0.01, metadata={"range": "(0, inf)"})  # finite-difference radius: eps = fd_eps / ||v||
    val_fraction: float = field(default=0.2, metadata={"range": "(0, 1)"})  # share of the labeled training shards held out as D_val (level III)
    split_seed: int = field(default=0, metadata={"range": "[0, 2147483647]"})  # salt of the per-sample hash split (data/split.py)
    variant: str = "mlo"  # mlo (three levels) | blo (BLO-MAE, Eq. 5)
    blo_gamma: float = field(default=1.0, metadata={"range": "[0, inf)"})  # BLO-MAE: weight of the reconstruction loss in the lower level
    mask_input_grad: bool = False  # let L1 reach the patch embedding through T's input (released code) [paper's Eq. 1: T reads data]
    level2_batch: str = "shared"  # D_tr batches of levels II/III: shared (level I's latest) | own (micro-batches before the last level-I step, as the released code's separate loader draws others)

    def validate(self) -> None:
        if self.unroll_lr not in ("schedule", "unit"):
            raise ValueError(f"mlomae.unroll_lr must be schedule or unit, got {self.unroll_lr!r}")
        if self.level2_batch not in ("shared", "own"):
            raise ValueError(f"mlomae.level2_batch must be shared or own, got {self.level2_batch!r}")
        if self.variant not in VARIANTS:
            raise ValueError(f"mlomae.variant must be one of {VARIANTS}, got {self.variant!r}")
        check_decoder("mlomae", self.decoder_dim, self.decoder_heads)

    # --- checks before any process starts (train/config/options.py, train/pretrain.py) ---------------
    def check_fits(self, img_size: int, patch_size: int, depth: int, micro_batch: int) -> None:
        check_mask_ratio("mlomae.mask_ratio", self.mask_ratio, (img_size // patch_size) ** 2)

    def check_engine(self, zero_stage: int, accum: int) -> None:
        if self.level2_steps > self.level1_steps * accum:
            raise ValueError(
                f"mlomae.level2_steps {self.level2_steps} exceeds the micro-batches of one cycle "
                f"(level1_steps {self.level1_steps} x gradient_accumulation_steps {accum}); lower it")

    def check_labels(self, num_classes: int | None) -> None:
        if num_classes is None:
            raise ValueError("objective mlomae splits the labeled shards and trains its level-II classifier on "
                             "the labels")
        if num_classes != self.num_classes:
            raise ValueError(f"the training labels have {num_classes} classes but mlomae.num_classes is "
                             f"{self.num_classes}; set --mlomae.num_classes {num_classes}")

    def data_split(self) -> tuple[float, int]:
        """(share held out as D_val, seed): the training index is split per sample (data/split.py)."""
        return self.val_fraction, self.split_seed

    def val_every(self, accum: int) -> int:
        """Micro-batches between D_val batches: the last micro-batch of every mask cycle."""
        return self.level1_steps * accum * self.mask_every


def _all_reduce_mean_(tensors: list[torch.Tensor]) -> None:
    if not (dist.is_available() and dist.is_initialized()) or not tensors:
        return
    flat = torch.cat([t.flatten() for t in tensors])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    for t, f in zip(tensors, flat.split([t.numel() for t in tensors])):
        t.copy_(f.view_as(t))


def _adamw(module: nn.Module, weight_decay: float, eps: float = 1e-8, decay_all: bool = False) -> torch.optim.AdamW:
    decay = [p for p in module.parameters() if p.ndim >= 2 or decay_all]
    rest = [p for p in module.parameters() if p.ndim < 2 and not decay_all]
    # fused: one kernel per group, and the step count a device tensor beside the moments (torch's
    # single-tensor AdamW keeps it on the host, which reads it every step and keeps the step out of a
    # CUDA graph); the update is AdamW's, to rounding
    return with_state(torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                                         {"params": rest, "weight_decay": 0.0}],
                                        lr=0.0, betas=(0.9, 0.95), eps=eps, fused=True))


class Auxiliary:
    """C and T with their optimizers: fp32, outside the objective's parameters (a plain attribute,
    not a submodule), so the engine neither casts, partitions nor optimises them."""

    def __init__(self, num_patches: int, dim: int, hidden: int, num_classes: int, weight_decay: float,
                 mask_eps: float = 1e-8, decay_all: bool = False):
        self.mask_net = MaskingNetwork(num_patches, dim, hidden)
        self.head = nn.Linear(dim, num_classes)  # the paper's single linear layer
        nn.init.trunc_normal_(self.head.weight, std=0.01)
        nn.init.zeros_(self.head.bias)
        self.weight_decay, self.mask_eps, self.decay_all = weight_decay, mask_eps, decay_all
        self.mask_opt = _adamw(self.mask_net, weight_decay, mask_eps, decay_all)
        self.head_opt = _adamw(self.head, weight_decay, decay_all=decay_all)

    def follow(self, device: torch.device) -> None:
        """Put C and T and their AdamW moments on `device` (the first forward there; a no-op after).
        Module.to moves only the parameters, and a resumed optimizer's moments were loaded onto the
        parameters' device at the time (CPU: the engine never sees these modules), so the
        optimizers are rebuilt from their own state_dict: it names parameters by position, and
        Optimizer.load_state_dict casts each moment to its parameter's device (and `load_fused` the
        step count too, which the fused kernel reads there). This also holds where Module.to replaces the Parameter objects
        (e.g. the meta device) instead of keeping them (CUDA)."""
        if self.head.weight.device == device:
            return
        mask_state, head_state = self.mask_opt.state_dict(), self.head_opt.state_dict()
        self.mask_net.to(device)
        self.head.to(device)
        self.mask_opt = _adamw(self.mask_net, self.weight_decay, self.mask_eps, self.decay_all)
        self.head_opt = _adamw(self.head, self.weight_decay, decay_all=self.decay_all)
        load_fused(self.mask_opt, mask_state)
        load_fused(self.head_opt, head_state)

    @staticmethod
    def step(module: nn.Module, opt: torch.optim.Optimizer, grads: list[torch.Tensor], lr: float) -> None:
        """Average grads over ranks, then one AdamW step (non-finite entries are zeroed)."""
        grads = [torch.nan_to_num(g.detach().float(), nan=0.0, posinf=0.0, neginf=0.0) for g in grads]
        _all_reduce_mean_(grads)
        for p, g in zip(module.parameters(), grads, strict=True):
            p.grad = g
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
        opt.zero_grad(set_to_none=True)

    def state_dict(self) -> dict:
        def cpu(x):
            if isinstance(x, torch.Tensor):
                return x.detach().cpu().clone()
            return {k: cpu(v) for k, v in x.items()} if isinstance(x, dict) else x
        return {"mask_net": cpu(self.mask_net.state_dict()), "head": cpu(self.head.state_dict()),
                "mask_opt": cpu(self.mask_opt.state_dict()), "head_opt": cpu(self.head_opt.state_dict())}

    def load_state_dict(self, state: dict) -> None:
        self.mask_net.load_state_dict(state["mask_net"])
        self.head.load_state_dict(state["head"])
        load_fused(self.mask_opt, state["mask_opt"])
        load_fused(self.head_opt, state["head_opt"])


@register_objective("mlomae", MLOMAEConfig)
class MLOMAEObjective(MAEObjective):
    """MAE (encoder, decoder, target, figures) with T's mask and weighting in level I."""

    hook_reads_weights = True  # levels II-III run the encoder (and its perturbations) after the step
    counted_flops = True  # levels II-III run after the optimizer step, outside the forward
    float8_refusal = ("its level III takes finite differences of fp32 copies of the weights, which float8 matmuls "
                      "would round away")

    def __init__(self, encoder: VisionTransformer, cfg: MLOMAEConfig):
        super().__init__(encoder, cfg)  # MLOMAEConfig carries MAE's fields (mask_ratio, norm_pix_loss, decoder_*)
        self.aux = Auxiliary(encoder.num_patches, encoder.embed_dim, cfg.mask_hidden, cfg.num_classes,
                             cfg.aux_weight_decay, cfg.mask_adam_eps, cfg.aux_decay_biases)
        self.level1_done = 0  # optimizer steps of E/D (level I) so far
        self.cycles_done = 0  # head (level II) cycles so far
        # What levels II and III read, kept from the steps' micro-batches (after_optimizer_step):
        self._tr_batches: deque = deque(maxlen=cfg.level2_steps)  # (image, label) of the latest micro-batches, across steps
        self._held: list = []  # level2_batch own: the last step's (image, label), level II's only from the next step on
        self._l1_images: torch.Tensor | None = None  # the last level-I micro-batch's images
        self._val: tuple[torch.Tensor, torch.Tensor] | None = None  # the cycle's D_val batch, until level III uses it

    # --- the generic hooks the loop and checkpoints use --------------------------------------
    def outside_parameters(self) -> list[torch.Tensor]:
        return [*self.aux.mask_net.parameters(), *self.aux.head.parameters()]

    def get_extra_state(self) -> dict:
        return {"aux": self.aux.state_dict(), "level1_done": self.level1_done, "cycles_done": self.cycles_done}

    def set_extra_state(self, state: dict) -> None:
        self.aux.load_state_dict(state["aux"])
        self.level1_done, self.cycles_done = int(state["level1_done"]), int(state["cycles_done"])

    def get_rank_state(self) -> dict[str, list[torch.Tensor]]:
        """The micro-batches (image, label; this rank's) that levels II-III will still read: with
        `level2_batch own` the last step's, held back; inside a cycle (level1_steps > 1) those kept
        so far, which its level II may reach back to (level2_steps > accum). At a cycle's end the
        next cycle's own micro-batches replace the kept ones (check_engine), so none are saved."""
        mid_cycle = self.level1_done % self.cfg.level1_steps != 0
        def flat(pairs) -> list[torch.Tensor]:
            return [t.detach().cpu() for pair in pairs for t in pair]
        return {"tr_batches": flat(self._tr_batches) if mid_cycle else [], "held": flat(self._held)}

    def set_rank_state(self, state: dict[str, list[torch.Tensor]]) -> None:
        device = self.encoder.pos_embed.device
        def pairs(tensors: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
            return [(img.to(device), label.to(device)) for img, label in zip(tensors[::2], tensors[1::2], strict=True)]
        self._tr_batches.clear()
        self._tr_batches.extend(pairs(state.get("tr_batches", [])))
        self._held = pairs(state.get("held", []))

    @property
    def after_step_period(self) -> int:
        return self.cfg.level1_steps * self.cfg.mask_every  # one level-III step, and a level-II step each cycle

    def after_optimizer_step(self, lr: float, batches: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Levels II and III on the schedule of the config; `lr` is the encoder's lr of this step,
        `batches` its micro-batches (D_tr `image` / `label`, and `val_image` / `val_label` on the
        one that closes a mask cycle). Returns the scalars of the levels that ran (logged for this step)."""
        if self.cfg.level2_batch == "own":  # level II reads only micro-batches the last level-I step did not train on
            self._tr_batches.extend(self._held)
            self._held = [(b["image"], b["label"]) for b in batches]
        for batch in batches:
            if self.cfg.level2_batch == "shared":
                self._tr_batches.append((batch["image"], batch["label"]))
            if "val_image" in batch:
                self._val = (batch["val_image"], batch["val_label"])
        if batches:
            self._l1_images = batches[-1]["image"]
        self.level1_done += 1
        if self.level1_done % self.cfg.level1_steps:
            return {}
        if not self._tr_batches:  # level2_batch own, first cycle (or after a resume): no batch of its own yet
            self.cycles_done += 1
            if self.cycles_done % self.cfg.mask_every == 0:
                self._val = None
            return {}
        stats = self.level2(lr * self.cfg.head_lr_scale)
        self.cycles_done += 1
        if self.cycles_done % self.cfg.mask_every == 0:
            if self._val is None:
                raise RuntimeError("mlomae: a mask cycle ended without a D_val batch; the data source must attach "
                                   "val_image/val_label every mlomae.val_every(accum) micro-batches (data/split.py)")
            stats |= self.level3(lr)
            self._val = None
        return stats

    # --- pieces shared by the levels ------------------------------------------------------------
    def mask_probabilities(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, C, H, W) -> patch tokens (B, N, D) with position, and T's probabilities (B, N): no
        gradient, or with `mask_input_grad` one to the tokens only (T's weights are read as constants)."""
        tokens = self.encoder.embed_patches(images)
        self.aux.follow(tokens.device)
        t_in = tokens.to(self.aux.head.weight.dtype)
        if self.cfg.mask_input_grad and torch.is_grad_enabled():
            weights = {k: v.detach() for k, v in self.aux.mask_net.named_parameters()}
            return tokens, functional_call(self.aux.mask_net, weights, (t_in,))
        with torch.no_grad():
            probs = self.aux.mask_net(t_in.detach())
        return tokens, probs

    def reconstruct(self, images: torch.Tensor, masking: Masking, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Per-patch MSE (B, N) of the MAE reconstruction under `masking` (every patch, masked or not)."""
        return per_patch_mse(self.decoder(self.encode(images, masking, tokens), masking.ids_restore), self.target(images))

    def cls_features(self, images: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> (B, D): the encoder's cls token on the whole image (levels II and III)."""
        return self.encoder.forward_features(images)[:, 0]

    def predict(self, images: torch.Tensor) -> torch.Tensor:
        """Level-II classifier: (B, C, H, W) -> logits (B, num_classes); its test accuracy is MLO-MAE's linear probe."""
        self.aux.follow(images.device)
        w = self.aux.head.weight
        return self.aux.head(self.cls_features(images).to(w.dtype))

    # --- level I ---------------------------------------------------------------------------------
    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        images = batch["image"]
        tokens, probs = self.mask_probabilities(images)
        masking = top_masking(probs, self.cfg.mask_ratio)
        per_patch = self.reconstruct(images, masking, tokens)
        loss = weighted_recon_loss(per_patch, masking.mask, probs, self.cfg.straight_through)
        out = {"recon_loss": ((per_patch * masking.mask).sum() / masking.mask.sum()).detach(),
               **mask_statistics(probs, masking.mask)}
        if self.cfg.variant == "blo":  # lower level of Eq. 5: gamma * L1 + CE on D_tr, C fixed in this step
            head = self.aux.head
            logits = F.linear(self.cls_features(images).float(), head.weight.detach(), head.bias.detach())
            cls_loss = F.cross_entropy(logits, batch["label"])
            loss = self.cfg.blo_gamma * loss + cls_loss
            out["blo_cls_loss"] = cls_loss.detach()
        return {"loss": loss, **out}

    # --- level II --------------------------------------------------------------------------------
    def level2(self, lr_head: float) -> dict[str, torch.Tensor]:
        head = self.aux.head
        losses, correct = [], []
        for images, labels in list(self._tr_batches)[-self.cfg.level2_steps:]:
            with torch.no_grad():
                feats = self.cls_features(images).to(head.weight.dtype)  # frozen encoder
            with torch.enable_grad():
                logits = head(feats)
                loss = F.cross_entropy(logits, labels)
                grads = torch.autograd.grad(loss, list(head.parameters()))
            Auxiliary.step(head, self.aux.head_opt, list(grads), lr_head)
            losses.append(loss.detach())
            correct.append((logits.argmax(1) == labels).float().mean().detach() * 100)
        return {"level2_loss": torch.stack(losses).mean(), "level2_train_top1": torch.stack(correct).mean()}

    # --- level III -------------------------------------------------------------------------------
    def fp32_state(self) -> dict[str, torch.Tensor]:
        """Every floating parameter and buffer of the objective in fp32 (the module's own tensors
        when it is fp32, copies otherwise), encoder parameters as gradient leaves."""
        state = {}
        for name, t in [*self.named_parameters(), *self.named_buffers()]:
            if t.dtype in (torch.float16, torch.bfloat16):
                t = t.detach().float().requires_grad_(name.startswith("encoder.") and t.requires_grad)
            state[name] = t
        return state

    def call(self, state: dict[str, torch.Tensor], method: str, *args):
        """self.<method>(*args) with the tensors of `state` in place of the objective's own."""
        return call_with(self, state, method, *args)

    def level1_loss(self, state, images, t_in, masking, track_encoder: bool = False) -> torch.Tensor:
        """L1 at the encoder/decoder tensors of `state`, differentiable w.r.t. T (and the encoder if asked).
        t_in None: T's input is recomputed from `state` (mask_input_grad: it moves with the perturbed encoder)."""
        if t_in is None:
            with torch.set_grad_enabled(track_encoder):
                t_in = self.call(state, "embed", images)
        probs = self.aux.mask_net(t_in)
        with torch.set_grad_enabled(track_encoder):
            per_patch = self.call(state, "reconstruct", images, masking)
        return weighted_recon_loss(per_patch, masking.mask, probs, self.cfg.straight_through)

    def class_loss(self, state, head: list[torch.Tensor], images, labels) -> torch.Tensor:
        """CE of the linear head (weight, bias) on the cls feature of the encoder tensors of `state`."""
        return F.cross_entropy(F.linear(self.call(state, "cls_features", images), *head), labels)

    def level3(self, lr: float) -> dict[str, torch.Tensor]:
        cfg = self.cfg
        images, (val_images, val_labels) = self._l1_images, self._val
        tr_images, tr_labels = self._tr_batches[-1]
        dtype = self.aux.head.weight.dtype
        with full_fp32(), torch.enable_grad():
            state = self.fp32_state()
            enc = [state[n] for n, p in self.named_parameters() if n.startswith("encoder.") and p.requires_grad]
            head = list(self.aux.head.parameters())
            img1, img2, img3 = (x.to(dtype) for x in (images, tr_images, val_images))
            with torch.no_grad():
                t_in = self.call(state, "embed", img1)
                masking = top_masking(self.aux.mask_net(t_in), cfg.mask_ratio)
            blo = cfg.variant == "blo"
            eta_enc, eta_head = (lr, lr * cfg.head_lr_scale) if cfg.unroll_lr == "schedule" else (1.0, 1.0)
            grads, stats = mask_hypergradient(
                level1=lambda: self.level1_loss(state, img1, None if cfg.mask_input_grad else t_in, masking),
                level2=lambda: self.class_loss(state, head, img2, tr_labels),
                level3=lambda: self.class_loss(state, head, img3, val_labels),
                mask_params=list(self.aux.mask_net.parameters()), points=Points.current(enc, head),
                lr_enc=eta_enc * (cfg.blo_gamma if blo else 1.0), lr_head=eta_head,
                through_head=cfg.through_head and not blo, eps_scale=cfg.fd_eps)
        Auxiliary.step(self.aux.mask_net, self.aux.mask_opt, grads, lr * cfg.mask_lr_scale)
        return stats

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        return self.encoder.embed_patches(images)

    # --- figures (the paper's Fig. 4) --------------------------------------------------------------
    def vis_masking(self, images: torch.Tensor, noise: torch.Tensor) -> Masking:
        return top_masking(self.mask_probabilities(images)[1], self.cfg.mask_ratio)

    @torch.no_grad()
    def visualizations(self, images: torch.Tensor, noise: torch.Tensor) -> dict[str, list[torch.Tensor]]:
        """MAE's rows under the learned mask, with T's probability map (brighter = more likely
        masked) in place of the raw reconstruction: original, masked input, map, reconstruction
        with the visible patches pasted."""
        rows = super().visualizations(images, noise)["mae_reconstruction"]
        probs = self.mask_probabilities(images)[1].float()  # (B, N)
        heat = probs[..., None].expand(-1, -1, self.patch_size ** 2)  # (B, N, p*p): one channel
        heat = unpatchify(heat, self.patch_size, self.encoder.patch_embed.grid_size, 1)
        return {"mlo_masks": [rows[0], rows[1], heat, rows[3]]}
