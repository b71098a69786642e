"""Training: the commands users type at this folder's top, and the rooms they are built from.

Commands (`python -m train.<name> --help`, or `python train/<name>.py`; `deepspeed
train/pretrain.py ...` on GPUs): pretrain, finetune, linprobe, evaluate, export, bench,
bench_objectives, convert_checkpoint. train/configs/ holds the `--config` presets.

Rooms, each importing only those above it (tests/test_layering.py):
    config/    what a run is asked to do: options, presets, the ds_config, the machine's checks
    engine/    the step on one rank, DDP or FSDP2, its process group, its checkpoint files
    weights/   weights in and out for other programs: timm and transformers exports, init_from
    estimate/  what a configuration costs: FLOPs, memory, communication, counts, the dry run
    run/       one run from start to stop: build, loop, trainer, run folder, signals, evaluation
"""
