"""The training-side iterator over shards: batches, a position record, skipped-sample counts."""
from __future__ import annotations

import torch

from data.shards import ERROR_KINDS, ShardSet, ShardStream, check_split
from data.transforms import PretrainTransform


def _one_thread(_: int) -> None:
    torch.set_num_threads(1)  # decode workers must not compete with the training process's threads


class ShardLoader:
    """Yields {"image": (B, 3, S, S), "label": (B,)} forever; `state_dict()` is its position.

    With W workers, PyTorch's DataLoader takes batch k from worker k mod W, so the number of
    batches consumed fixes how far each worker's stream has advanced and whose turn is next.
    """

    def __init__(self, shards: ShardSet, img_size: int, batch_size: int, seed: int, rank: int, world: int,
                 num_workers: int, shuffle_buffer: int, crop_scale_min: float = 0.2, pin_memory: bool = False,
                 transform=None, keep=None):
        check_split(shards, world, num_workers)
        self.shards, self.batch_size, self.seed, self.rank, self.world = shards, batch_size, seed, rank, world
        self.num_workers, self.shuffle_buffer, self.pin_memory = num_workers, shuffle_buffer, pin_memory
        self.transform = transform or PretrainTransform(img_size, scale=(crop_scale_min, 1.0))
        self.keep = keep  # sample-key filter: only the keys it accepts are read (data/split.py)
        self.batches = 0
        self.errors = torch.zeros(max(1, num_workers), len(ERROR_KINDS), dtype=torch.long)  # latest per worker
        self._it = None

    def _skip_per_worker(self) -> list[int]:
        W = max(1, self.num_workers)
        return [max(0, (self.batches - w + W - 1) // W) * self.batch_size for w in range(W)]

    def _start(self):
        stream = ShardStream(self.shards, self.transform, self.seed, self.rank, self.world, self.num_workers,
                             self.shuffle_buffer, self._skip_per_worker(), self.batches % max(1, self.num_workers),
                             self.keep)
        loader = torch.utils.data.DataLoader(
            stream, batch_size=self.batch_size, num_workers=self.num_workers, pin_memory=self.pin_memory,
            persistent_workers=self.num_workers > 0, prefetch_factor=4 if self.num_workers > 0 else None,
            worker_init_fn=_one_thread,
            # Starting workers draws a base seed; from the global RNG it would shift the training
            # process's random stream (masking noise) depending on when the loader started.
            generator=torch.Generator().manual_seed(self.seed),
        )
        return iter(loader)

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self._it is None:
            self._it = self._start()
        batch = next(self._it)
        self.errors[int(batch["worker"][0])] = batch["errors"][-1]
        self.batches += 1
        return {"image": batch["image"], "label": batch["label"]}

    def counters(self) -> dict[str, int]:
        """Samples skipped so far on this rank, by kind (summed over workers)."""
        return {f"data_skipped_{k}": int(v) for k, v in zip(ERROR_KINDS, self.errors.sum(0).tolist(), strict=True)}

    def state_dict(self) -> dict:
        return {"batches": self.batches, "errors": self.errors.tolist(), "num_workers": self.num_workers,
                "batch_size": self.batch_size, "world": self.world, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        for key in ("num_workers", "batch_size", "world", "seed"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"the data position was recorded with {key}={state[key]}, this run has {getattr(self, key)}; "
                    f"the stream can only be continued with the same value"
                )
        self.batches = int(state["batches"])
        self.errors = torch.tensor(state["errors"], dtype=torch.long)
        self._it = None  # restart the workers at the recorded position
