"""Weights in and out for other programs: encoders exported to timm and Hugging Face transformers
from a checkpoint, the encoder (and MAE decoder) a run starts from (`--model.init_from`), and
whether a weights file fits the configured model, judged from its tensor shapes before start.
Reading weights files of other formats is model/interop.py's and model/hf_interop.py's. Imports
train/config/ and train/engine/ (a checkpoint tag's files).

    export.py        timm export, a tag's encoder and decoder, where an export may write
    transformers.py  Hugging Face transformers folders (ViTMAEForPreTraining, ViTModel, ...)
    fit.py           `--model.init_from` against the configured encoder, from the file's shapes
"""
