"""The engine's two failures that end a run on every rank with exit 3 (train/run/cli.py), its last
complete checkpoint kept. Here, apart from the modules that raise them, so that a command's front
can name them without importing the engine (torch.distributed.checkpoint and the wrappers)."""


class NonFiniteError(RuntimeError):
    """Training diverged: the run ends and keeps its last checkpoint (train/engine/nonfinite.py)."""


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written on some rank (a full disk, a quota, a lost mount): the run
    stops on every rank (exit 3), the previous checkpoint kept (train/engine/checkpoint.py)."""
