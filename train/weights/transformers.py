"""A checkpoint as a Hugging Face transformers folder (`train/export.py --format transformers`):

    config.json               ViTMAEConfig / ViTConfig of the run's sizes, `architectures` set
    model.safetensors         fp32 weights in transformers' file layout (model/hf_interop.py)
    preprocessor_config.json  ViTImageProcessor: the run's image size, bicubic, ImageNet mean/std
    README.md                 model card: objective, recipe, data index, the run's last metrics

What is written: a pretraining run of `mae` -> ViTMAEForPreTraining (encoder + decoder); a run
whose encoder has a classifier (finetune) -> ViTForImageClassification with the labels of the
training shards' index when it names them; any other run -> its encoder as ViTModel (loaded with
`add_pooling_layer=False`: transformers' default adds a pooler the encoder does not have).
Refused: average-pooled encoders (model.global_pool avg; transformers' ViT normalises every token
and classifies the cls token), iRPE encoders and timm backbones (no place in transformers' ViT).
The folder is written beside `out` under a temporary name, loaded back with the installed
transformers (nothing missing, unexpected or mis-shaped, or the export fails and the temporary
folder is removed) and only then moved to `out`.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from data.outputs import written_whole
from data.synthetic import mean_std
from model.hf_interop import WITH_VIT_PREFIX, to_transformers, transformers_config

INSTALL = "pip install -e '.[hf]'"
WRITTEN = ("config.json", "model.safetensors", "preprocessor_config.json", "README.md")
BICUBIC = 3  # PIL's resampling code, as transformers' image processors record it


def require_transformers():
    """The transformers package, or a one-line error saying how to install it."""
    try:
        import transformers
    except ImportError:
        raise ValueError(f"--format transformers needs the transformers package, which is not installed: "
                         f"{INSTALL}") from None
    return transformers


def choose_architecture(meta: dict, encoder: dict[str, torch.Tensor], decoder: dict[str, torch.Tensor]) -> str:
    """The transformers class the checkpoint becomes, or a ValueError saying why none can hold it."""
    kwargs = meta["encoder_timm_kwargs"]
    if "timm_model" in kwargs:
        raise ValueError(f"the encoder is the timm backbone {kwargs['timm_model']}, which transformers' ViT cannot "
                         f"hold: export it with --format timm")
    if kwargs.get("rpe"):
        raise ValueError("the encoder has iRPE tables (relative positions), which transformers' ViT has no place for: "
                         "export it with --format timm (it loads into this repository's ViT)")
    if kwargs["global_pool"] != "token":
        raise ValueError("the encoder pools the patch tokens (model.global_pool avg: fc_norm after the mean); "
                         "transformers' ViT normalises every token and classifies the cls token, so no transformers "
                         "class computes this model: export it with --format timm, or fine-tune with "
                         "--model.global_pool token")
    if "head.weight" in encoder:
        return "ViTForImageClassification"
    if meta["objective"] == "mae" and decoder:
        return "ViTMAEForPreTraining"
    return "ViTModel"


def class_names(meta: dict, classes: int) -> list[str] | None:
    """The training shards' class names (their index's `classes`), when the index is still there
    and names as many classes as the head has."""
    index = meta["config"]["data"].get("train_index")
    try:
        names = json.loads(Path(index).read_text()).get("classes") if index else None
    except (OSError, ValueError, AttributeError):
        return None
    return [str(n) for n in names] if isinstance(names, list) and len(names) == classes else None


def build_config(transformers, name: str, meta: dict, arch: dict, classes: int):
    """The transformers config object of the export."""
    section = meta["config"].get(meta["objective"], {})
    if name == "ViTMAEForPreTraining":
        decoder = {k: section[k] for k in ("decoder_dim", "decoder_depth", "decoder_heads")}
        config = transformers.ViTMAEConfig(**transformers_config(arch, decoder, section["mask_ratio"],
                                                                 section["norm_pix_loss"]))
    else:
        labels = {}
        if classes:
            names = class_names(meta, classes) or [f"LABEL_{i}" for i in range(classes)]
            labels = {"id2label": dict(enumerate(names)), "label2id": {n: i for i, n in enumerate(names)}}
        config = transformers.ViTConfig(**transformers_config(arch), **labels)
    config.architectures = [name]
    return config


def image_processor(transformers, img_size: int, in_chans: int):
    """ViTImageProcessor with the run's input size and normalisation (bicubic, as our transforms resize)."""
    mean, std = mean_std(in_chans)
    return transformers.ViTImageProcessor(do_resize=True, size={"height": img_size, "width": img_size},
                                          resample=BICUBIC, do_rescale=True, rescale_factor=1 / 255,
                                          do_normalize=True, image_mean=mean, image_std=std)


def loading_lines(name: str, out: Path | str) -> str:
    """The Python lines that load the export from `out` (a folder, or the Hub repository it is pushed to)."""
    extra = ", add_pooling_layer=False" if name == "ViTModel" else ""
    return "\n".join([f"from transformers import {name}",
                      f"model = {name}.from_pretrained({str(out)!r}{extra})"])


def _options(values: dict) -> str:
    return ", ".join(f"{k} {json.dumps(v)}" for k, v in values.items())


def last_metrics(run_dir: Path, step: int) -> dict | None:
    """The run's last metrics.jsonl line at or before the checkpoint's step."""
    try:
        lines = (run_dir / "metrics.jsonl").read_text(errors="replace").splitlines()  # train/run/folder.py's
    except OSError:
        return None
    rows = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:  # empty, or a line cut short by a crash
            continue
        if isinstance(row, dict) and type(row.get("step")) is int and row["step"] <= step:
            rows.append(row)
    return rows[-1] if rows else None


def model_card(name: str, meta: dict, arch: dict, tag_dir: Path, labels: int) -> str:
    """README.md of the export: what was trained, how, on what, and where it ended."""
    cfg = meta["config"]
    objective, optim, data, model = meta["objective"], cfg["optim"], cfg["data"], cfg["model"]
    metrics = last_metrics(tag_dir.parent.parent, meta["step"])
    shown = {k: v for k, v in (metrics or {}).items() if isinstance(v, (int, float))}
    metric_text = _options({k: round(v, 6) if isinstance(v, float) else v for k, v in shown.items()}) \
        if shown else "none (no metrics.jsonl beside the checkpoint)"
    data_text = f"`{data['train_index']}`" if data["source"] == "shards" else "synthetic images (data.source synthetic)"
    mean, std = mean_std(arch["in_chans"])
    # transformers' pipelines read every image as RGB, and image-feature-extraction runs ViTMAEModel with the
    # config's mask_ratio (features of a random quarter of the patches): a tag only where the pipeline is right
    pipeline = "image-classification" if name == "ViTForImageClassification" else "image-feature-extraction"
    tagged = arch["in_chans"] == 3 and name != "ViTMAEForPreTraining"
    lines = [
        "---", "library_name: transformers", *([f"pipeline_tag: {pipeline}"] if tagged else []),
        f"tags: [vision, {objective}]", "---", "",
        f"# {model['name']} trained with `{objective}` ({name})", "",
        f"Exported by `train/export.py --format transformers` from checkpoint `{tag_dir.name}` of the run "
        f"`{tag_dir.parent.parent.name}` (optimizer step {meta['step']}).", "",
        "| | |", "|---|---|",
        f"| objective | `{objective}`: {_options(cfg.get(objective, {}))} |",
        f"| encoder | `{model['name']}`: {arch['img_size']} px, patch {arch['patch_size']}, width {arch['embed_dim']}, "
        f"{arch['depth']} blocks, {arch['num_heads']} heads, in_chans {arch['in_chans']} |",
        f"| recipe | global batch {meta.get('global_batch')}, {_options(optim)} (lr = blr x global batch / 256) |",
        f"| data | {data_text}, train_transform {data['train_transform']} |",
        f"| trained | {meta['step']} optimizer steps |",
        f"| last metrics | {metric_text} |",
    ]
    if labels:
        lines.append(f"| classes | {labels} (id2label in config.json) |")
    lines += [
        "", "## Load", "", "```python", loading_lines(name, "<this folder or its Hub repository>"), "```", "",
        "## Preprocessing", "",
        f"`preprocessor_config.json` resizes to {arch['img_size']} x {arch['img_size']} (bicubic), rescales to [0, 1] "
        f"and normalises with mean {mean} and std {std}, as the run's inputs were. The run's own evaluation resized "
        f"the shorter side to img_size / {data['eval_crop_pct']} and center-cropped; ViTImageProcessor resizes the "
        f"whole image.", "",
        "## Differences from transformers' defaults", "",
        "- `layer_norm_eps` is 1e-6, as the model was trained (transformers' ViT default: 1e-12).",
    ]
    if name == "ViTMAEForPreTraining":
        lines.append(f"- `norm_pix_loss` is {str(cfg[objective]['norm_pix_loss']).lower()}, as the run trained "
                     f"(transformers' default: false). Pass the same `noise` to compare masks: the patches of "
                     f"smallest noise are kept.")
        patches = (arch["img_size"] // arch["patch_size"]) ** 2
        lines += [
            "", "## Features", "",
            f"`mask_ratio` is the run's {cfg[objective]['mask_ratio']}, so the encoder as saved sees a random "
            f"{1 - cfg[objective]['mask_ratio']:g} of the patches. For features of the whole image, load the encoder "
            f"with nothing masked, and pass a `noise` that keeps the patches in image order:", "",
            "```python", "import torch", "from transformers import ViTMAEModel",
            "encoder = ViTMAEModel.from_pretrained('<this folder>', mask_ratio=0.0)",
            f"noise = torch.arange({patches}).expand(pixel_values.shape[0], -1)",
            "features = encoder(pixel_values=pixel_values, noise=noise).last_hidden_state  # (B, 1 + patches, width)",
            "```", "",
            "transformers' `image-feature-extraction` pipeline would run the saved `mask_ratio`, so this card names "
            "no pipeline.",
        ]
    if name == "ViTModel":
        lines.append("- No pooler: load with `add_pooling_layer=False` (the default adds a randomly initialised "
                     "dense + tanh on the cls token). The features are `last_hidden_state`.")
    return "\n".join(lines) + "\n"


def check_loads(transformers, name: str, folder: Path) -> None:
    """The installed transformers loads the folder with nothing missing, unexpected or mis-shaped."""
    extra = {"add_pooling_layer": False} if name == "ViTModel" else {}
    _, info = getattr(transformers, name).from_pretrained(str(folder), output_loading_info=True, **extra)
    wrong = {k: sorted(info[k])[:5] for k in ("missing_keys", "unexpected_keys", "mismatched_keys") if info.get(k)}
    if wrong:
        raise ValueError(f"transformers {transformers.__version__} loads the {name} export with {wrong}: the export "
                         f"does not match this transformers version; nothing was written to the output folder")


def write_folder(encoder: dict[str, torch.Tensor], decoder: dict[str, torch.Tensor], meta: dict, tag_dir: Path,
                 out: Path) -> tuple[Path, str]:
    """Write the export of a checkpoint tag (its fp32 encoder and MAE decoder, by our names, and
    complete.json) to `out`. Returns (out, the transformers class name)."""
    transformers = require_transformers()
    out = Path(out)
    if out.exists() and (not out.is_dir() or set(p.name for p in out.iterdir()) - set(WRITTEN)):
        raise ValueError(f"--out {out} holds other files than a transformers export's ({', '.join(WRITTEN)}); "
                         f"give a new or empty folder")
    name = choose_architecture(meta, encoder, decoder)
    kwargs = meta["encoder_timm_kwargs"]
    arch = {k: kwargs[k] for k in ("img_size", "patch_size", "in_chans", "embed_dim", "depth", "num_heads",
                                   "mlp_ratio")}
    head = {k: v for k, v in encoder.items() if k.startswith("head.")}
    body = {k: v for k, v in encoder.items() if not k.startswith("head.")}
    classes = head["head.weight"].shape[0] if head else 0
    state = to_transformers(body, decoder if name == "ViTMAEForPreTraining" else None, head,
                            vit_prefix=name in WITH_VIT_PREFIX)
    with written_whole(out) as partial:  # an earlier export (checked above) is replaced whole
        partial.mkdir(parents=True)
        save_file(state, str(partial / "model.safetensors"), metadata={"format": "pt"})  # transformers reads "format"
        build_config(transformers, name, meta, arch, classes).save_pretrained(str(partial))
        image_processor(transformers, arch["img_size"], arch["in_chans"]).save_pretrained(str(partial))
        (partial / "README.md").write_text(model_card(name, meta, arch, tag_dir, classes))
        check_loads(transformers, name, partial)
    return out, name
