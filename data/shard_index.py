"""Shard indexes: which tars a set holds, how many samples each, their classes and labels.

An index (data/write_shards.py, data/index_shards.py) must list at least one shard, each with
samples and a non-empty file, named by its path relative to the index's folder or by an absolute
path (an entry with a '..' component is refused: it could name any file); a `pipe:<shell
command>` entry (webdataset's URL for a tar on a command's stdout) runs only with
data.allow_pipe_urls, and other URLs are refused.

Labels: an index that says `"labeled": false` (data/index_shards.py, for shards without labels)
is read without labels: its samples need only an image, and its batches carry no "label" key, so
anything that reads labels fails on the first batch instead of training on a stand-in value
(objectives and evaluations that read labels refuse such an index before start: `require_labels`).
A labeled index (the default; data/write_shards.py's) is read with its `label_key` (data/labels.py).

An evaluation set is scored against a training set's labels only when both indexes give the same
class names to the same integers (`check_scored_against`) and share no shard (`check_held_out`),
both judged from the indexes alone.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from data.cli import read_json
from data.faults import ShardIndexError
from data.folders import is_file_named
from data.labels import DEFAULT_LABEL_KEY, LabelKey

URL_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


@dataclass(frozen=True)
class PipeShard:
    """A shard read from the stdout of a shell command: the index entry `pipe:<command>`."""
    url: str

    @property
    def command(self) -> str:
        return self.url[len("pipe:"):]

    @property
    def name(self) -> str:
        """Names the shard in sample ids (no '/'): the base name of the command's last word that
        mentions .tar (`pipe:curl -s https://host/train-000001.tar` -> train-000001.tar), else the
        whole command with every run of other characters than [A-Za-z0-9._-] replaced by '_'."""
        return shard_name(self.url)

    def __str__(self) -> str:
        return self.url


def shard_name(url: str) -> str:
    """The name of the shard a sample's `__url__` points at (a file's name, or PipeShard.name)."""
    if not url.startswith("pipe:"):
        return Path(url).name
    tars = [w for w in url[len("pipe:"):].split() if ".tar" in w]
    return tars[-1].rstrip("/").rsplit("/", 1)[-1] if tars else re.sub(r"[^A-Za-z0-9._-]+", "_", url)


@dataclass(frozen=True)
class ShardSet:
    """A set of shards described by a JSON index (data/write_shards.py, data/index_shards.py)."""

    files: tuple[Path | PipeShard, ...]
    counts: tuple[int, ...]
    classes: tuple[str, ...]  # () in an unlabeled set
    index: Path | None = None  # the index file it was read from (corrupt-data messages name it)
    labeled: bool = True  # every sample carries a label under label_key; False: read without labels
    label_key: str = DEFAULT_LABEL_KEY  # where the labels are (data/labels.py)
    # the labels found in the shards when they were indexed (data/index_shards.py's "labels_seen"); None where
    # the index does not record them (data/write_shards.py's, whose labels are the positions of its classes)
    labels_seen: tuple[int, ...] | None = None

    @property
    def num_samples(self) -> int:
        return sum(self.counts)

    @property
    def labels(self) -> LabelKey | None:
        """How samples' labels are read; None: they are not (an unlabeled set)."""
        return LabelKey.parse(self.label_key) if self.labeled else None

    def require_labels(self, reason: str) -> None:
        """Refuse an unlabeled set (ShardIndexError, a ValueError) for a reader of labels; `reason`
        says who reads them (e.g. "objective finetune trains its classifier on labels"), the message
        adds the index and the fix. Nothing for a labeled set."""
        if self.labeled:
            return
        raise ShardIndexError(
            f"{reason}, but the shard index {self.index or '(not from a file)'} is unlabeled (\"labeled\": false: "
            f"not every sample has a {self.label_key!r} label). Point it at labeled shards: index them with "
            f"python -m data.index_shards SHARDS... --out INDEX.json --label_key KEY (KEY: the member holding each "
            f"sample's integer class, cls, or json:FIELD for a field of its json member) or write them with "
            f"data/write_shards.py. Objectives that read no labels (e.g. mae) pretrain on this index as it is.")

    def possible_labels(self) -> tuple[int, ...]:
        """The labels this labeled set may hold, known without reading a shard: those its index
        recorded, else one per class it names."""
        return self.labels_seen or tuple(range(len(self.classes)))

    def check_label_key(self, label_key: str, option: str = "data.label_key") -> None:
        """A labeled set's labels are read only under the key it was indexed with (ValueError otherwise);
        an empty key asks for that one."""
        if self.labeled and label_key and LabelKey.parse(label_key) != LabelKey.parse(self.label_key):
            raise ShardIndexError(
                f"{option} is {label_key!r}, but the labels of the shard index {self.index} are under "
                f"{self.label_key!r} (the key it was indexed with); pass --{option} {self.label_key}, or re-index the "
                f"shards with python -m data.index_shards ... --label_key {label_key}")

    @classmethod
    def from_index(cls, path: str | Path, allow_pipe_urls: bool = False) -> "ShardSet":
        """Raises FileNotFoundError for a missing index or shard file, ShardIndexError for an index
        that cannot feed training (no shards, empty shards, malformed entries, refused URLs)."""
        path = Path(path)
        if path.is_dir():
            found = sorted(p.name for p in path.glob("*.json"))
            hint = f" (it holds {', '.join(found[:3])})" if found else ""
            raise FileNotFoundError(f"shard index {path} is a folder{hint}: give the index file itself, the "
                                    f"<name>.json that data/write_shards.py or data/index_shards.py wrote into it")
        if not path.is_file():
            raise FileNotFoundError(f"shard index {path} not found; write shards with data/write_shards.py")
        index = read_json(path, "shard index")  # malformed: refused with its line and column
        entries = index.get("shards") if isinstance(index, dict) else None
        labeled = index.get("labeled", True) if isinstance(index, dict) else True  # absent: write_shards' cls labels
        classes = index.get("classes", None if labeled else []) if isinstance(index, dict) else None
        if not isinstance(entries, list) or not isinstance(classes, list):
            raise ShardIndexError(f"shard index {path} has no 'shards' or 'classes' list; is it an index written by "
                                  f"data/write_shards.py or data/index_shards.py?")
        label_key = index.get("label_key", DEFAULT_LABEL_KEY)
        if not isinstance(labeled, bool) or not isinstance(label_key, str):
            raise ShardIndexError(f"shard index {path}: 'labeled' must be true or false and 'label_key' a string, got "
                                  f"{labeled!r} and {label_key!r}")
        try:
            LabelKey.parse(label_key)
        except ValueError as e:
            raise ShardIndexError(f"shard index {path}: {e}") from None
        labels_seen = index.get("labels_seen")
        if labels_seen is not None and not (isinstance(labels_seen, list) and all(
                isinstance(y, int) and not isinstance(y, bool) for y in labels_seen)):
            raise ShardIndexError(f"shard index {path}: 'labels_seen' must be a list of integer labels, got "
                                  f"{str(labels_seen)[:60]}; re-index the shards (python -m data.index_shards)")
        if not entries:
            raise ShardIndexError(f"shard index {path} lists no shards; there is nothing to train on")
        malformed = [e for e in entries if not isinstance(e, dict) or not isinstance(e.get("file"), str)
                     or not isinstance(e.get("samples"), int) or isinstance(e.get("samples"), bool)]
        if malformed:
            raise ShardIndexError(f"shard index {path}: {len(malformed)} 'shards' entries lack a 'file' name or an "
                                  f"integer 'samples' count, e.g. {malformed[0]!r}")
        files = tuple(_shard_file(path, e["file"], allow_pipe_urls) for e in entries)
        missing = [str(f) for f in files if isinstance(f, Path) and not is_file_named(f)]
        if missing:
            raise FileNotFoundError(f"{len(missing)} shard(s) listed in {path} are missing, e.g. {missing[:3]}")
        empty = [e["file"] for e, f in zip(entries, files) if e["samples"] <= 0 or
                 (isinstance(f, Path) and f.stat().st_size == 0)]
        if empty:
            raise ShardIndexError(f"shard index {path}: {len(empty)} shard(s) hold no samples (a count <= 0 or a "
                                  f"zero-byte file), e.g. {empty[:3]}; rewrite them (data/write_shards.py) or "
                                  f"remove them from the index")
        names = [f.name for f in files]
        if len(set(names)) < len(names):
            twice = sorted({n for n in names if names.count(n) > 1})
            raise ShardIndexError(f"shard index {path}: shard names repeat ({twice[:3]}); sample ids are "
                                  f"<shard name>/<key>, so every shard needs its own name")
        return cls(files, tuple(e["samples"] for e in entries), tuple(classes), path, labeled=labeled,
                   label_key=label_key, labels_seen=tuple(labels_seen) if labels_seen and labeled else None)


def _shard_file(index: Path, entry: str, allow_pipe_urls: bool) -> Path | PipeShard:
    """An index entry as a local path (relative to the index) or, when allowed, a pipe: command."""
    if entry.startswith("pipe:"):
        if not allow_pipe_urls:
            raise ShardIndexError(f"shard index {index}: entry {entry!r} is a pipe: URL, which runs a shell command; "
                                  f"set data.allow_pipe_urls true only if you trust whoever wrote the index")
        return PipeShard(entry)
    if URL_SCHEME.match(entry):  # (an absolute path, as data/index_shards.py writes for shards elsewhere, is kept)
        raise ShardIndexError(f"shard index {index}: entry {entry!r} is a URL; shards are read from local files or "
                              f"from a command's output: write the entry as a pipe: command (e.g. 'pipe:curl -sfL "
                              f"{entry}' or 'pipe:aws s3 cp {entry} -') and set data.allow_pipe_urls true")
    if ".." in Path(entry).parts:  # the writers never climb: a shard under the index's folder is named below it
        raise ShardIndexError(f"shard index {index}: entry {entry!r} climbs with '..' and may name a file outside the "
                              f"index's folder; name a shard by its path under that folder or by its absolute path, "
                              f"as python -m data.index_shards SHARDS... --out INDEX.json writes them")
    return index.parent / entry


CLASS_LIST_FIX = ("give both the same class list in the same order: write the test shards with the training index's "
                  "classes (python -m data.write_shards imagefolder|imagenet ... --classes_from TRAIN_INDEX.json), or "
                  "for shards of other writers index both with one --classes NAMES.txt (python -m data.index_shards)")


def check_scored_against(test: ShardSet, train: ShardSet, test_option: str, train_option: str) -> None:
    """`test` is scored with what was fitted on `train`'s labels, so an integer label must mean the same
    class in both. Judged from the two indexes alone, before any shard is read: every label an index
    records lies inside its own classes; the class names agree position by position (the test index
    may name only the first of the training classes: a test set of fewer classes); no label the test
    index may hold (`possible_labels`) lies past the training classes. ShardIndexError naming both
    indexes, what disagrees and the fix. Both sets are labeled (`require_labels` first)."""
    for shards, option in ((train, train_option), (test, test_option)):
        outside = [y for y in shards.possible_labels() if not 0 <= y < len(shards.classes)]
        if outside:
            raise ShardIndexError(f"{option} {shards.index} records label {outside[0]} (its labels_seen) but names "
                                  f"{len(shards.classes)} classes: re-index the shards with a --classes file naming "
                                  f"every class (python -m data.index_shards SHARDS... --classes NAMES.txt)")
    names = f"{test_option} {test.index} does not fit {train_option} {train.index}"
    differ = next((i for i, (a, b) in enumerate(zip(test.classes, train.classes)) if a != b), None)
    if differ is not None:
        raise ShardIndexError(f"{names}: label {differ} is class {test.classes[differ]!r} in {test_option} and "
                              f"{train.classes[differ]!r} in {train_option}, so their labels mean other classes; "
                              f"{CLASS_LIST_FIX}")
    past = [y for y in test.possible_labels() if y >= len(train.classes)]
    if past:
        raise ShardIndexError(f"{names}: {test_option} may hold label {past[0]} (class {test.classes[past[0]]!r}), "
                              f"{train_option} names {len(train.classes)} classes, so that class can never be "
                              f"predicted; score on the training classes only, or {CLASS_LIST_FIX}")


def check_held_out(test: ShardSet, train: ShardSet, test_option: str, train_option: str) -> None:
    """`test` measures what was learned from `train`, so it must hold none of `train`'s shards: the
    same index file, or one that lists a shard of the other (the same file, or the same pipe:
    command), would report accuracy on training samples. ShardIndexError naming both and the fix."""
    shared = sorted({_shard_key(f) for f in test.files} & {_shard_key(f) for f in train.files})
    if not shared:
        return
    same = test.index is not None and train.index is not None and \
        Path(test.index).resolve() == Path(train.index).resolve()
    what = (f"is the same index as {train_option}" if same else
            f"lists {len(shared)} of the shards {train_option} {train.index} lists (e.g. {shared[0]})")
    raise ShardIndexError(f"{test_option} {test.index} {what}: its accuracy would be measured on samples the model was "
                          f"fitted on; point {test_option} at a held-out split (e.g. the val or test index "
                          f"python -m data.write_shards writes beside the training one)")


def _shard_key(f: Path | PipeShard) -> str:
    """A shard's identity across indexes: its resolved path, or its pipe: URL."""
    return f.url if isinstance(f, PipeShard) else str(f.resolve())


def check_split(shards: ShardSet, world: int, num_workers: int) -> None:
    """Every (rank, worker) pair needs at least one shard per epoch, or it would wait forever.
    num_workers -1 (auto, data/loader.py) never asks for more workers than there are shards."""
    if num_workers < -1:
        raise ValueError(f"data.num_workers must be >= 0, or -1 for auto, got {num_workers}")
    readers = world * max(1, num_workers)
    if len(shards.files) < readers:
        fewer = (f", or use fewer workers (--data.num_workers {len(shards.files) // world})"
                 if num_workers > 1 and len(shards.files) >= world else "")
        what = f"{world} ranks x {num_workers} workers" if num_workers > 0 else \
            f"{world} ranks (each reads in its own process with --data.num_workers 0)"
        raise ValueError(
            f"{len(shards.files)} shards cannot feed {what} = {readers} readers: each reads whole shards. Write "
            f"at least {readers} shards (data/write_shards.py with a smaller --samples_per_shard){fewer}"
        )
