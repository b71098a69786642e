"""The training-side iterator over shards: batches on the device, a position record, skipped and
converted sample counts."""
from __future__ import annotations

import atexit
import multiprocessing
import os
import signal
import time
import weakref

import torch

from data.faults import ERROR_KINDS, CorruptDataError, big_image_hint, padded, verify_hint
from data.image_modes import CONVERTED_KINDS
from data.reshard import ReaderLayout, consumed
from data.shard_index import ShardSet, check_split
from data.shards import DEFAULT_MAX_IMAGE_PIXELS, ShardStream, StreamStart, shards_for
from data.transforms import PretrainTransform, normalize_uint8


def _init_worker(_: int) -> None:
    torch.set_num_threads(1)  # decode workers must not compete with the training process's threads
    # Stop requests are the training process's to act on (train/run/preemption.py); a worker that
    # died of one first would take the batch stream, and the checkpoint, with it. SIGINT too: a
    # Ctrl-C reaches every process of the terminal's foreground group.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


AUTO_WORKERS = -1  # data.num_workers default: fit the machine (resolve_num_workers)
# Auto's ceiling: MAE's official pretraining runs 10 workers per GPU; at the ~550 images/s per worker
# of docs/DATA.md's CPU table (RandomResizedCrop 224 of ImageNet-sized JPEGs) 10 feed ~5,500 images/s,
# the rate of an H100 at about 33% MFU on MAE ViT-B, where 4 fed ~2,200, below the 3,100 measured
MAX_AUTO_WORKERS = 10


def cores_per_rank() -> int:
    """CPU cores this rank may use: the process's affinity set (Slurm / taskset / a container's
    cpuset) divided among the ranks of this node (LOCAL_WORLD_SIZE: torchrun, our Slurm mode;
    LOCAL_SIZE: the deepspeed launcher). Ranks bound to their own cores get a share of their share:
    fewer workers than they could run, never more than the cores."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable = os.cpu_count() or 1
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or 1))
    if (per_task := slurm_task_cpus(local)) is not None:  # the rank is a Slurm task: its CPUs are its own
        return max(1, min(usable, per_task))
    return max(1, usable // local)


def slurm_task_cpus(local: int) -> int | None:
    """SLURM_CPUS_PER_TASK when each of this node's `local` ranks is a task of the Slurm step (srun
    with one task per rank, launchers/pretrain.sbatch's task mode), else None. Such a task sees only
    its own CPUs where Slurm binds tasks (dividing them again among the node's ranks left 5 // 8 = 0
    loader workers), and the whole allocation where it does not; either way it may use this many."""
    env = os.environ
    if "SLURM_PROCID" not in env or not env.get("SLURM_CPUS_PER_TASK", "").isdigit():
        return None
    tasks = int(env.get("SLURM_STEP_NUM_TASKS", "1"))
    nodes = max(1, int(env.get("SLURM_STEP_NUM_NODES", env.get("SLURM_NNODES", "1"))))
    return int(env["SLURM_CPUS_PER_TASK"]) if tasks > 1 and tasks // nodes == local else None


def resolve_num_workers(requested: int, num_shards: int | None = None, world: int = 1) -> int:
    """data.num_workers as the DataLoader takes it: a count >= 0 is kept; AUTO_WORKERS (-1) is
    min(MAX_AUTO_WORKERS (10), cores per rank - 1, shards per rank), at least 0: one core stays with the training
    process (so the DataLoader's "more workers than cores" warning never fires), and every worker
    gets a shard. 0 decodes in the training process."""
    if requested < AUTO_WORKERS:
        raise ValueError(f"data.num_workers must be >= 0, or -1 for auto, got {requested}")
    if requested >= 0:
        return requested
    auto = min(MAX_AUTO_WORKERS, cores_per_rank() - 1)
    if num_shards is not None:
        auto = min(auto, num_shards // max(1, world))
    return max(0, auto)


_LIVE_LOADERS: weakref.WeakSet = weakref.WeakSet()  # loaders whose workers may be running


@atexit.register  # after torch and multiprocessing registered theirs: runs before them
def _end_workers_at_exit() -> None:
    """Multiprocessing ends daemon children at exit with SIGTERM and then waits for them. Workers
    ignore SIGTERM (above), so a process ending while a loader is alive (training raised) would wait
    forever. Close the loaders (the DataLoader ends its workers); then, for any worker left, send
    SIGTERM as multiprocessing would, and SIGKILL to whatever is still running after 1 s."""
    for loader in list(_LIVE_LOADERS):
        loader.close()
    children = [p for p in multiprocessing.active_children() if p.daemon]
    for p in children:
        p.terminate()
    deadline = time.monotonic() + 1.0
    for p in children:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()


class ShardLoader:
    """Yields {"image": (B, ...) float32, "label": (B,)} on `device`, forever; `state_dict()` is its position.
    An unlabeled shard set (ShardSet.labeled False) yields {"image"} alone: no label to misread.

    Workers deliver uint8 crops (or, with an nvjpeg transform, JPEG bytes that are decoded here on
    the device); they are copied from pinned memory without blocking and normalised on the device.
    With W workers, PyTorch's DataLoader takes batch k from worker k mod W, so the number of
    batches consumed says whose turn is next, and the position of the last sample of each worker's
    latest batch says where that worker's stream continues.

    max_bad_fraction / max_image_pixels: see ShardStream (the training source passes data.*; the
    default 1.0 never gives up).
    """

    def __init__(self, shards: ShardSet, img_size: int, batch_size: int, seed: int, rank: int, world: int,
                 num_workers: int, shuffle_buffer: int, crop_scale_min: float = 0.2, pin_memory: bool = False,
                 transform=None, keep=None, device: torch.device | str = "cpu", max_bad_fraction: float = 1.0,
                 max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS):
        num_workers = resolve_num_workers(num_workers, len(shards.files), world)
        check_split(shards, world, num_workers)
        self.shards, self.batch_size, self.seed, self.rank, self.world = shards, batch_size, seed, rank, world
        self.num_workers, self.shuffle_buffer, self.pin_memory = num_workers, shuffle_buffer, pin_memory
        self.transform = transform or PretrainTransform(img_size, scale=(crop_scale_min, 1.0))
        self.keep = keep  # sample-key filter: only the keys it accepts are read (data/split.py)
        self.max_bad_fraction, self.max_image_pixels = max_bad_fraction, max_image_pixels
        self.device = torch.device(device)
        self.device_decoder = None
        if getattr(self.transform, "device_decode", False):
            from data.device_decode import DeviceDecoder

            self.device_decoder = DeviceDecoder(img_size, self.device)
        W = max(1, num_workers)
        self.batches = 0
        self.delivered_before = 0  # samples every rank delivered under earlier world sizes (resume_from)
        self.start = StreamStart.fresh(W)
        self.last = list(self.start.last)  # per worker: (epoch, pos) of the last sample delivered
        self.layout: ReaderLayout | None = None  # the earlier readers whose samples are skipped, if any
        self.errors = torch.zeros(W, len(ERROR_KINDS), dtype=torch.long)  # per worker, since it started
        self.errors_before = torch.zeros(len(ERROR_KINDS), dtype=torch.long)  # counted before the last resume
        self.converted = torch.zeros(W, len(CONVERTED_KINDS), dtype=torch.long)  # the same for converted samples
        self.converted_before = torch.zeros(len(CONVERTED_KINDS), dtype=torch.long)
        self._it = None

    def _start(self):
        start = StreamStart(list(self.last), self.start.start_epoch, self.start.consumed, self.start.legacy_skip)
        stream = ShardStream(self.shards, self.transform, self.seed, self.rank, self.world, self.num_workers,
                             self.shuffle_buffer, start, self.batches % max(1, self.num_workers), self.keep,
                             self.max_bad_fraction, self.max_image_pixels)
        collate = None if self.device_decoder is None else self.device_decoder.collate
        loader = torch.utils.data.DataLoader(
            stream, batch_size=self.batch_size, num_workers=self.num_workers, pin_memory=self.pin_memory,
            persistent_workers=self.num_workers > 0, prefetch_factor=4 if self.num_workers > 0 else None,
            worker_init_fn=_init_worker, collate_fn=collate,
            # Starting workers draws a base seed; from the global RNG it would shift the training
            # process's random stream (masking noise) depending on when the loader started.
            generator=torch.Generator().manual_seed(self.seed),
        )
        _LIVE_LOADERS.add(self)
        return iter(loader)

    def __iter__(self):
        return self

    def close(self) -> None:
        """Stop the workers; the next batch starts them again at the recorded position. (Freeing
        the DataLoader's iterator is how it ends its workers.)"""
        self._it = None

    def __next__(self) -> dict[str, torch.Tensor]:
        if self._it is None:
            self._it = self._start()
        try:
            batch = next(self._it)
        except Exception as e:  # e.g. CorruptDataError
            self.close()
            if self.num_workers > 0:  # re-raised from a worker, whose traceback is in the message
                # The traceback's DataLoader frames would keep the iterator, and its workers, alive
                # until a garbage collection (or for good, were it to propagate to exit); without
                # them the iterator is freed now and ends its workers.
                e.with_traceback(None)
                if isinstance(e, CorruptDataError):  # the shards' fault, said in full: no traceback wanted
                    raise CorruptDataError(worker_message(e)) from None
                raise e
            raise
        worker = int(batch["worker"][0])  # bookkeeping on CPU tensors: no device sync
        self.errors[worker] = batch["errors"][-1]
        self.converted[worker] = batch["converted"][-1]
        self.last[worker] = (int(batch["epoch"][-1]), int(batch["pos"][-1]))
        self.batches += 1
        if self.device_decoder is not None:
            images = self.device_decoder(batch["image"])
        else:
            images = batch["image"].to(self.device, non_blocking=True)
        if images.dtype == torch.uint8:
            images = normalize_uint8(images)
        if "label" not in batch:  # an unlabeled set (data/shards.py)
            return {"image": images}
        return {"image": images, "label": batch["label"].to(self.device, non_blocking=True)}

    def _skipped(self) -> torch.Tensor:
        """(len(ERROR_KINDS),) samples skipped on this rank since the run began."""
        total = self.errors_before + self.errors.sum(0)
        if self.device_decoder is not None:  # JPEGs the device could not decode
            total[ERROR_KINDS.index("undecodable_image")] += self.device_decoder.failed
        return total

    def _converted(self) -> torch.Tensor:
        """(len(CONVERTED_KINDS),) samples converted to 8-bit RGB on this rank since the run began."""
        return self.converted_before + self.converted.sum(0)

    def counters(self) -> dict[str, int]:
        """Samples skipped and converted so far on this rank, by kind (summed over workers)."""
        skipped = {f"data_skipped_{k}": int(v) for k, v in zip(ERROR_KINDS, self._skipped().tolist(), strict=True)}
        converted = zip(CONVERTED_KINDS, self._converted().tolist(), strict=True)
        return {**skipped, **{f"data_converted_{k}": int(v) for k, v in converted}}

    def check_unusable(self, counters: dict[str, int], delivered: int | None = None) -> None:
        """The give-up rule over the whole run so far, for `counters` summed over every rank (the
        loop's read at a run's last step): each reader applies it only once it has seen a shard's
        worth of samples, which a short run may never reach. `delivered`: the samples those
        counters stand against, when other loaders than this one counted too (default: this
        loader's). Raises CorruptDataError."""
        bad = sum(v for k, v in counters.items() if k.startswith("data_skipped_"))
        examined = (self.delivered() if delivered is None else delivered) + bad
        if bad and bad > self.max_bad_fraction * examined:
            raise CorruptDataError(
                f"{bad} of {examined} samples read were unusable ({bad / examined:.1%}), above data.max_bad_fraction "
                f"{self.max_bad_fraction:g} (by kind: " + ", ".join(
                    f"{k.removeprefix('data_skipped_')} {v}" for k, v in counters.items()
                    if k.startswith("data_skipped_") and v) + "). Fix or rewrite the shards (data/write_shards.py; "
                "--skip_bad leaves unreadable files out), or raise data.max_bad_fraction (1.0 disables this check). "
                + big_image_hint({k.removeprefix("data_skipped_") for k, v in counters.items()
                                  if k.startswith("data_skipped_") and v})
                + verify_hint(self.shards.index))

    def delivered(self) -> int:
        """Samples every rank has delivered to the step since the run began, across world sizes."""
        return self.delivered_before + self.batches * self.batch_size * self.world

    def state_dict(self) -> dict:
        return {"batches": self.batches, "delivered_before": self.delivered_before, "last": [list(p) for p in self.last],
                "errors": self._skipped().tolist(),
                "converted": self._converted().tolist(),
                "num_workers": self.num_workers, "batch_size": self.batch_size, "world": self.world,
                "seed": self.seed, "shuffle_buffer": self.shuffle_buffer, "start_epoch": self.start.start_epoch,
                "layout": self.layout.to_dict() if self.layout else None}

    def load_state_dict(self, state: dict) -> None:
        """Continue from this rank's own position (same world size and workers)."""
        for key in ("num_workers", "world", "seed"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"the data position was recorded with {key}={state[key]}, this run has {getattr(self, key)}; "
                    f"the stream can only be continued with the same value"
                )
        self.batches = int(state["batches"])
        self.delivered_before = int(state.get("delivered_before", 0))  # absent: recorded before it was
        self.errors = torch.zeros_like(self.errors)
        self.converted = torch.zeros_like(self.converted)
        if "last" not in state:  # recorded before positions were: replay decoded samples, as then
            W = max(1, self.num_workers)
            if state["batch_size"] != self.batch_size:
                raise ValueError("this data position (an older format) needs the same micro-batch size to continue")
            skip = [max(0, (self.batches - w + W - 1) // W) * self.batch_size for w in range(W)]
            self.start = StreamStart.fresh(W)
            self.start.legacy_skip = skip
            self.errors_before = torch.zeros(len(ERROR_KINDS), dtype=torch.long)  # the replay counts them again
            self.converted_before = torch.zeros(len(CONVERTED_KINDS), dtype=torch.long)  # not recorded then
            self._it = None
            return
        if state["shuffle_buffer"] != self.shuffle_buffer:
            raise ValueError(f"the data position was recorded with data.shuffle_buffer {state['shuffle_buffer']}, "
                             f"this run has {self.shuffle_buffer}; resume with the same value")
        self.layout = ReaderLayout.from_dict(state["layout"])
        self._set_start(state["start_epoch"], [tuple(p) for p in state["last"]])
        self.errors_before, self.converted_before = _counts(state)

    def resume_from(self, states: list[dict]) -> None:
        """Continue from the positions of every rank of a checkpointed run (rank order). With the
        same readers (world size x workers) this rank continues its own stream; otherwise the new
        readers skip exactly what the old ones delivered (data/reshard.py)."""
        if len(states) == self.world and states[0].get("num_workers") == self.num_workers:
            self.load_state_dict(states[self.rank])
            return
        if any("last" not in s for s in states):
            raise ValueError("this checkpoint's data positions predate per-sample positions; resume it on the world "
                             "size and data.num_workers it was written with")
        if states[0]["seed"] != self.seed or states[0]["shuffle_buffer"] != self.shuffle_buffer:
            raise ValueError("a change of world size keeps the data order only with the same seed and "
                             "data.shuffle_buffer as the checkpointed run")
        self.layout = ReaderLayout.from_states(states)
        # the give-up rule's denominator: what the old ranks delivered (each state: its rank's
        # batches; delivered_before is the same on every rank of a layout)
        self.delivered_before = int(states[0].get("delivered_before", 0)) + sum(
            int(s["batches"]) * int(s["batch_size"]) for s in states)
        self.batches = 0
        self.errors = torch.zeros_like(self.errors)
        self.converted = torch.zeros_like(self.converted)
        errors, converted = (torch.stack(t).sum(0) for t in zip(*map(_counts, states)))
        mine = self.rank == 0  # counters are summed over ranks: the old totals start on rank 0
        self.errors_before = errors if mine else torch.zeros_like(errors)
        self.converted_before = converted if mine else torch.zeros_like(converted)
        self._set_start(None, None)

    def _set_start(self, start_epoch: int | None, last: list[tuple[int, int]] | None) -> None:
        """Positions and the skip list of the earlier layout, if any; None: a fresh start after it."""
        W = max(1, self.num_workers)
        skip: dict = {}
        first = 0
        if self.layout is not None:
            readers = range(self.rank * W, (self.rank + 1) * W)
            n = len(self.shards.files)

            def mine(epoch: int) -> set[int]:
                return {i for r in readers for i in shards_for(n, epoch, self.seed, r, self.world * W)}

            first, skip = consumed(self.layout, self.shards, mine)
        start_epoch = first if start_epoch is None else start_epoch
        self.start = StreamStart([(start_epoch, -1)] * W, start_epoch, skip)
        self.last = list(last) if last is not None else list(self.start.last)
        self._it = None  # restart the workers at the recorded position


def worker_message(e: Exception) -> str:
    """The message an exception had in a DataLoader worker. PyTorch re-raises it in the training
    process with the worker's traceback in front ("Caught CorruptDataError in DataLoader worker
    process 0.\nOriginal Traceback (most recent call last): ... data.faults.CorruptDataError:
    <message>"): a 20-line traceback around a message that already says what is wrong and what to
    do. The formatted traceback ends with `<module>.<class name>: <message>`."""
    text = str(e)
    head = f"{type(e).__module__}.{type(e).__qualname__}: "
    if not text.startswith("Caught ") or head not in text:  # raised in this process: as it is
        return text
    return text.rsplit(head, 1)[1].rstrip("\n")


def _counts(state: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(skipped, converted) counts of a saved position; states written before newer kinds (or the
    converted counts) existed read as zeros for them."""
    return (torch.tensor(padded(state["errors"], len(ERROR_KINDS)), dtype=torch.long),
            torch.tensor(padded(state.get("converted", []), len(CONVERTED_KINDS)), dtype=torch.long))
