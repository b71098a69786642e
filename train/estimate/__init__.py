"""What a configuration costs, before or without running it: FLOPs and activations of a
micro-batch, memory per rank, communication per step and its overlap, CPU time of a benchmark,
kernel launches and host syncs of a step, and the dry run that reports them for a world size and
GPU. Imports train/config/, train/engine/ and train/weights/.

    costs.py       FLOPs and activation bytes of one micro-batch, from the objective on the meta device
    memory.py      peak memory per rank and the largest micro-batch that fits; the floor a step needs
    comm_model.py  bytes per rank per step over the links and how much compute hides them;
                   scaling.py feeds it the configuration's FSDP units
    counting.py    kernel launches, collectives and host syncs per step and phase (tools/census.py)
    cpu_time.py    how long a benchmark sized for a GPU would take on this CPU
    gpus.py        the GPUs this code knows: peak FLOP/s, memory, bf16, compute capability
    dry_run.py     `--dry-run`: every check and estimate for N ranks on a named GPU, starting nothing
"""
