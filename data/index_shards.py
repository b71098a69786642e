"""Index webdataset shards that exist already (written by webdataset's ShardWriter, img2dataset,
ImageNet in webdataset form, ...) without rewriting them: the JSON index ShardSet.from_index reads.

    python -m data.index_shards 'shards/train-{000000..000146}.tar' --out shards/train.json
    python -m data.index_shards /data/laion/ --out laion.json --workers 32
    python -m data.index_shards a.tar b.tar --out ab.json --label_key json:label --classes names.txt

SHARDS: brace patterns (expanded as webdataset does), folders (their *.tar files, by name) or tar
files, in the order given; 'pipe:<command>' entries only with --allow_pipe_urls. Shards are read
by --workers processes (default: the cores available), tar headers only: a member's data is read
only for the label. Samples are members grouped by key as webdataset groups them (`<key>.<ext>`,
the key ending at the first dot of the file name). A sample is indexed when it has a non-empty
image member (data/shards.py IMAGE_KEYS: jpg, jpeg, png, webp, then other formats PIL decodes:
gif, bmp, tiff, ...; the first one present is the one the reader reads); others are counted as
rejected, with examples.

Labels (--label_key, read as data/labels.py reads them in training): MEMBER (default cls) = a
member whose text is an integer; MEMBER:FIELD (e.g. json:label) = a field of a JSON member holding
an integer (or its text). Labels must be >= 0.
The index is labeled when every indexed sample has a label; its classes are then the names of
--classes (one per line, line i = label i), else those of the data/write_shards.py index that lists
every shard (`<name>.json` beside `<name>-000000.tar`: the writer's class list), else "0" .. "K-1"
(K = the largest label + 1). Shards data/write_shards.py wrote carry the positions of its class
list as labels, so --classes must name the same class at every label they hold (refused otherwise:
the labels are not rewritten; write the shards with the wanted list, --classes_from). An
unlabeled index has no classes: it feeds pretraining objectives, not those that read labels.

The index ({"name", "pattern", "shards": [{"file", "samples"}], "num_samples", "classes",
"rejected", ...}, see `build_index`) names a shard by its path relative to the index's folder
when it lies under it, else by its absolute path. A shard that is not a tar, cut short (also at a
member boundary: no end-of-archive marker) or holds no sample is bad: the indexer names each with
the reason and exits 1 writing nothing, or with --skip_bad leaves them out and lists them in the
index. Exit status 2: the input cannot be indexed (no shards, repeated shard names, labels that
do not fit --classes). The output is the same whatever --workers.

--out is refused before any shard is read when it is one of the inputs (a shard, the --classes
file; symbolic links resolved) or names a .tar file, and when it exists, unless --overwrite or it is
an index this indexer wrote (a rerun replaces it); the index is written under a temporary name and
renamed, so an interrupted write leaves no half index.
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a script: our packages are at the repository root
    import sys
    from pathlib import Path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import json
import os
import re
import stat
import sys
import tarfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from braceexpand import braceexpand
from webdataset.tariterators import base_plus_ext, group_by_keys

from data.cli import InputError, Parser
from data.faults import SampleError, Tally
from data.folders import unwritable_file
from data.labels import LabelKey
from data.loader import cores_per_rank
from data.outputs import check_output, written_whole
from data.progress import mapped
from data.shard_index import URL_SCHEME, PipeShard, shard_name
from data.shards import IMAGE_KEYS, UnreadMember, _is_sample_member, member_limit, pipe_members, read_label


OWN_KEYS = {"members", "unlabeled", "bad_shards"}  # build_index's, which data/write_shards.py's indexes lack
WRITER_SHARD = re.compile(r"(.+)-\d{6}\.tar")  # data/write_shards.py's <name>-000000.tar, indexed by <name>.json


class IndexingError(ValueError):
    """Input that cannot be indexed at all (exit status 2)."""


class NotATarError(tarfile.ReadError):
    """A shard file that tarfile cannot open."""


@dataclass
class ShardScan:
    """What one shard holds: indexed samples (with an image), the members they carry, their labels;
    samples without an image (rejected) and indexed samples without a label (unlabeled)."""
    shard: Path | PipeShard
    samples: int = 0
    members: Counter = field(default_factory=Counter)
    labels: Counter = field(default_factory=Counter)  # label -> samples
    unlabeled: Tally = field(default_factory=Tally)
    rejected: Tally = field(default_factory=Tally)
    bad: str = ""  # why the shard cannot be indexed ('' = good)
    writer: WriterClasses | None = None  # the class list data/write_shards.py wrote it with, when its index is there


@dataclass(frozen=True)
class WriterClasses:
    """The classes of the data/write_shards.py index that lists a shard: its cls label i is classes[i]."""
    index: Path
    classes: tuple[str, ...]


def writer_classes(shard: Path | PipeShard, label: LabelKey) -> WriterClasses | None:
    """The class list a shard's cls labels were written with: that of the data/write_shards.py index
    beside it (`<name>.json` for `<name>-000000.tar`) when that index lists it; None otherwise (another
    writer's shards, another label key, a pipe: command)."""
    match = WRITER_SHARD.fullmatch(shard.name) if isinstance(shard, Path) else None
    if match is None or label != LabelKey():
        return None
    path = shard.parent / f"{match[1]}.json"
    index = index_at(path)
    if index is None or OWN_KEYS & set(index):
        return None
    classes, entries = index.get("classes"), index.get("shards")
    if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes) or not isinstance(entries, list):
        return None
    listed = any(isinstance(e, dict) and e.get("file") == shard.name for e in entries)
    return WriterClasses(path, tuple(classes)) if listed else None


def index_at(path: Path) -> dict | None:
    """The JSON object in the regular file `path`, or None (no such file, not a regular one: a FIFO is
    never opened, unreadable, not JSON, nested too deep, not an object)."""
    try:
        if not stat.S_ISREG(path.stat().st_mode):
            return None
        index = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return None
    return index if isinstance(index, dict) else None


def check_writer_classes(scans: list[ShardScan], class_names: list[str], classes_file: str) -> None:
    """--classes names the labels data/write_shards.py wrote into the shards, which it took from its own
    class list: the names must agree with that list at every label a shard holds, or the index would
    name each sample by another class than its own. IndexingError naming the first that differs."""
    for scan in scans:
        if scan.writer is None:
            continue
        for y in sorted(scan.labels):
            written = scan.writer.classes[y] if y < len(scan.writer.classes) else None
            given = class_names[y] if y < len(class_names) else None
            if given is not None and written != given:
                raise IndexingError(
                    f"--classes {classes_file} does not fit {scan.shard}: data.write_shards wrote its label {y} as "
                    f"class {written!r} (the classes of {scan.writer.index}), --classes line {y + 1} names {given!r}, "
                    f"so its samples would be named by another class. Leave --classes out to take "
                    f"{scan.writer.index.name}'s names, or write the shards again with the class list you mean: "
                    f"python -m data.write_shards imagefolder SRC OUT --name NAME --classes_from TRAIN_INDEX.json")


def common_writer_classes(scans: list[ShardScan], labels: Counter) -> list[str] | None:
    """The class list data/write_shards.py wrote every shard with, when it is one list naming every label seen."""
    lists = {s.writer.classes if s.writer is not None else None for s in scans}
    if len(lists) != 1 or None in lists:
        return None
    [classes] = lists
    return list(classes) if max(labels) < len(classes) else None


def _tar_members(path: Path, label_member: str) -> Iterator[dict]:
    """Sample members of a local tar from their headers: `data` is the member's size, or its bytes
    for the label member (an UnreadMember, not read, when over its data/shards.py member_limit).
    Raises tarfile.ReadError for a member cut short and for a missing
    end-of-archive marker (a file cut at a member boundary, which tarfile reads without a word)."""
    size = os.path.getsize(path)
    try:
        tar = tarfile.open(path, mode="r:")
    except tarfile.TarError as e:
        raise NotATarError(str(e) or type(e).__name__) from None
    with tar:
        for m in tar:
            if not _is_sample_member(m):
                continue
            if m.offset_data + m.size > size:
                raise tarfile.ReadError(f"member {m.name} is cut short ({max(0, size - m.offset_data)} of {m.size} "
                                        f"bytes)")
            is_label = (base_plus_ext(m.name)[1] or "").lower() == label_member
            yield {"fname": m.name, "data": _label_data(tar, m) if is_label else m.size, "__url__": str(path)}
        tar.fileobj.seek(tar.offset)
        end = tar.fileobj.read(2 * tarfile.BLOCKSIZE)
    if len(end) < 2 * tarfile.BLOCKSIZE or end.strip(b"\0"):
        raise tarfile.ReadError(f"no end-of-archive marker after the last member (at byte {tar.offset} of {size})")


def _label_data(tar: tarfile.TarFile, m: tarfile.TarInfo) -> bytes | UnreadMember:
    """A label member's bytes, or its size alone when it is larger than the reader reads (judged from the header)."""
    return UnreadMember(m.size) if m.size > member_limit(m.name) else tar.extractfile(m).read()


def _pipe_members(shard: PipeShard, label_member: str) -> Iterator[dict]:
    """As `_tar_members`, from a command's output (data/shards.py's reader: a stream is read whole)."""
    for m in pipe_members(shard):
        is_label = (base_plus_ext(m["fname"])[1] or "").lower() == label_member
        yield {**m, "data": m["data"] if is_label else len(m["data"])}


def scan_shard(shard: Path | PipeShard, label: LabelKey) -> ShardScan:
    """Count one shard's samples, members and labels (see ShardScan)."""
    scan, name = ShardScan(shard), shard_name(str(shard))
    if isinstance(shard, Path) and not shard.is_file():
        scan.bad = "not found"
        return scan
    members = _pipe_members(shard, label.member) if isinstance(shard, PipeShard) else _tar_members(shard, label.member)
    try:
        for sample in group_by_keys(members):  # webdataset's grouping: lower-case extensions, repeats refused
            key, exts = f"{name}/{sample['__key__']}", sorted(k for k in sample if not k.startswith("__"))
            image = next((e for e in IMAGE_KEYS if e in sample), None)  # the reader's pick
            if image is None:
                scan.rejected.add(key, f"no image member (members: {', '.join(exts) or 'none'})")
                continue
            if sample[image] == 0:
                scan.rejected.add(key, f"the {image} member is empty")
                continue
            scan.samples += 1
            scan.members.update(exts)
            if not label.present(sample):
                scan.unlabeled.add(key, f"missing_cls: no {label.member} member")
                continue
            try:
                scan.labels[read_label(label, sample)] += 1  # as the reader reads it: an integer >= 0
            except SampleError as e:
                scan.unlabeled.add(key, str(e))
    except NotATarError as e:
        scan.bad = f"not a tar file ({e})"
    except (tarfile.TarError, OSError, EOFError) as e:
        scan.bad = f"cut short or damaged after {scan.samples + scan.rejected.count} whole samples: " \
                   f"{str(e) or type(e).__name__}"
    except (ValueError, RecursionError) as e:  # a member name repeats within a sample; headers tarfile cannot parse
        scan.bad = f"unreadable after {scan.samples + scan.rejected.count} whole samples: {str(e) or type(e).__name__}"
    if not scan.bad and not scan.samples:
        scan.bad = f"no sample with an image member ({scan.rejected.count} without one)"
    return scan


def _scan_one(job: tuple[Path | PipeShard, LabelKey]) -> ShardScan:
    return scan_shard(*job)


def scan_shards(shards: list[Path | PipeShard], label: LabelKey, workers: int = 0) -> list[ShardScan]:
    """One scan per shard, in the order given; `workers` processes (0 = the cores available)."""
    jobs = [(s, label) for s in shards]
    workers = min(workers or cores_per_rank(), len(jobs))
    return mapped(_scan_one, jobs, workers, "indexing", chunksize=max(1, len(jobs) // (8 * max(1, workers))))


def expand(sources: list[str], allow_pipe_urls: bool = False) -> list[Path | PipeShard]:
    """The shards that brace patterns, folders and files name, in order; raises IndexingError for
    refused URLs, empty folders and shard names that repeat (sample ids are <shard name>/<key>)."""
    shards: list[Path | PipeShard] = []
    for source in sources:
        for entry in braceexpand(source):
            if entry.startswith("pipe:"):
                if not allow_pipe_urls:
                    raise IndexingError(f"{entry!r} is a pipe: URL, which runs a shell command; pass "
                                        f"--allow_pipe_urls (and set data.allow_pipe_urls true to train on the index)")
                shards.append(PipeShard(entry))
            elif URL_SCHEME.match(entry):
                raise IndexingError(f"{entry!r} is a URL; shards are read from local files or from a command's "
                                    f"output: write it as a pipe: command (e.g. 'pipe:curl -sfL {entry}') with "
                                    f"--allow_pipe_urls")
            elif Path(entry).is_dir():
                tars = sorted(p for p in Path(entry).iterdir() if p.suffix == ".tar" and p.is_file())
                if not tars:
                    raise IndexingError(f"folder {entry} holds no .tar files")
                shards += tars
            else:
                shards.append(Path(entry))
    if not shards:
        raise IndexingError("no shards given")
    missing = [str(s) for s in shards if isinstance(s, Path) and not s.exists()]
    if missing:
        raise IndexingError(f"{len(missing)} of {len(shards)} shards do not exist, e.g. {missing[:3]}: check the "
                            f"paths and patterns (brace patterns name every file they expand to)")
    names = [shard_name(str(s)) for s in shards]
    if len(set(names)) < len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise IndexingError(f"shard names repeat ({twice[:3]}); sample ids are <shard name>/<key>, so every shard "
                            f"needs its own name (rename the files or index them separately)")
    return shards


def index_entry(shard: Path | PipeShard, out: Path) -> str:
    """How the index names a shard: the pipe: URL, the path relative to the index's folder when the
    shard lies under it, else the absolute path (ShardSet.from_index joins entries to the index's
    folder, which leaves an absolute path as it is)."""
    if isinstance(shard, PipeShard):
        return shard.url
    path, folder = os.path.abspath(shard), os.path.abspath(out.parent)
    inside = os.path.commonpath([path, folder]) == folder
    return os.path.relpath(path, folder) if inside else path


def read_classes(path: Path) -> list[str]:
    if not path.is_file():
        raise IndexingError(f"--classes {path} {'is a folder' if path.is_dir() else 'does not exist'}: give a text "
                            f"file of class names, one per line (line i = label i)")
    try:
        names = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise IndexingError(f"--classes {path} cannot be read as text ({type(e).__name__}: {e}): give a UTF-8 text "
                            f"file of class names, one per line") from None
    while names and not names[-1].strip():
        names.pop()
    blank = [i for i, n in enumerate(names) if not n.strip()]
    if blank or not names:
        raise IndexingError(f"--classes {path}: expected one class name per line (line i = label i), "
                            f"{'the file is empty' if not names else f'line {blank[0] + 1} is blank'}")
    return [n.strip() for n in names]


def build_index(scans: list[ShardScan], out: Path, label: LabelKey, name: str, pattern: str,
                class_names: list[str] | None = None, classes_file: str = "") -> dict:
    """The index of the good shards (bad ones listed under bad_shards). Keys beyond data/write_shards.py's:
    members (samples carrying each member), label_key, labeled (every sample has a label),
    labels_seen, unlabeled (samples without a usable label: count, examples), bad_shards. Shards data/write_shards.py
    wrote (`ShardScan.writer`) keep the names of its class list: `class_names` must agree with it."""
    good = [s for s in scans if not s.bad]
    rejected, unlabeled, members, labels = Tally(), Tally(), Counter(), Counter()
    for s in good:
        rejected.merge(s.rejected)
        unlabeled.merge(s.unlabeled)
        members.update(s.members)
        labels.update(s.labels)
    labeled = bool(good) and unlabeled.count == 0
    classes: list[str] = []
    if class_names is not None:
        if not labeled:
            raise IndexingError(f"--classes given, but {unlabeled.count} samples have no {label} label, e.g. "
                                f"{unlabeled.examples[:3]}; fix --label_key, or leave --classes out to index them "
                                f"as unlabeled")
        check_writer_classes(good, class_names, classes_file)
        if max(labels) >= len(class_names):
            raise IndexingError(f"label {max(labels)} does not fit the {len(class_names)} names of --classes")
        classes = class_names
    elif labeled:
        classes = common_writer_classes(good, labels) or [str(c) for c in range(max(labels) + 1)]
    return {
        "name": name,
        "pattern": pattern,
        "shards": [{"file": index_entry(s.shard, out), "samples": s.samples} for s in good],
        "num_samples": sum(s.samples for s in good),
        "classes": classes,
        "rejected": rejected.as_json(),
        "members": dict(sorted(members.items())),
        "label_key": str(label),
        "labeled": labeled,
        "labels_seen": sorted(labels),
        "unlabeled": unlabeled.as_json(),
        "bad_shards": [{"file": str(s.shard), "reason": s.bad} for s in scans if s.bad],
    }


def write_index(index: dict, out: Path) -> None:
    """Written under a temporary name and renamed: a reader never sees half an index."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with written_whole(out) as tmp:
        tmp.write_text(json.dumps(index, indent=1))


def check_out(out: Path, shards: list[Path | PipeShard], classes: Path | None, overwrite: bool) -> None:
    """Before any shard is read: --out is none of the input files (a shard, the class names), and
    replaces no existing file without --overwrite but an index of this indexer's (a rerun). The
    index may lie in the shards' folder (it is JSON; the folder's .tar files are the shards), so a
    .tar name is refused: it would be read as a shard of that folder next time."""
    inputs = [s for s in shards if isinstance(s, Path)] + ([classes] if classes is not None else [])
    check_output(out, inputs, overwrite or is_our_index(out), "--out")
    if out.suffix == ".tar":
        raise InputError(f"--out {out} names a .tar file, but the index is JSON (a folder's .tar files are read as "
                         f"its shards): give INDEX.json")


def is_our_index(path: Path) -> bool:
    """Whether `path` is a regular file holding an index this indexer wrote (its own keys, which
    data/write_shards.py's indexes lack)."""
    index = index_at(path)
    return index is not None and OWN_KEYS <= set(index)


def summary(index: dict, out: Path) -> str:
    members = ", ".join(f"{k} x{n}" for k, n in index["members"].items())
    labels = (f"labeled ({len(index['classes'])} classes, label key {index['label_key']})" if index["labeled"] else
              f"unlabeled ({index['unlabeled']['count']} of {index['num_samples']} samples have no "
              f"{index['label_key']} label): for pretraining objectives that read no labels")
    return (f"{out}: {index['num_samples']} samples in {len(index['shards'])} shards, {labels}; members: {members}; "
            f"{index['rejected']['count']} rejected (no usable image member), {len(index['bad_shards'])} bad shards "
            f"left out")


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m data.index_shards", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("shards", nargs="+", metavar="SHARDS",
                   help="brace patterns, folders of .tar files, tar files, or pipe: commands (with --allow_pipe_urls)")
    p.add_argument("--out", type=Path, required=True, help="the index to write (INDEX.json)")
    p.add_argument("--name", default="", help="the index's name (default: the --out file's name without .json)")
    p.add_argument("--label_key", default="cls",
                   help="MEMBER holding an integer label, or MEMBER:FIELD of a JSON member (default %(default)s)")
    p.add_argument("--classes", type=Path, default=None,
                   help="class names, one per line (line i = label i); default: the labels as text")
    p.add_argument("--workers", type=int, default=0, help="processes reading shards (default 0: the cores available)")
    p.add_argument("--skip_bad", action="store_true", help="index the good shards and list the bad ones in the index")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    p.add_argument("--allow_pipe_urls", action="store_true",
                   help="accept pipe:<command> shards (the command runs in a shell: only commands you trust)")
    a = p.parse_args(argv)
    if a.workers < 0:
        p.error("--workers must be >= 0")
    try:
        label = LabelKey.parse(a.label_key)
    except ValueError as e:
        p.error(f"--label_key: {e}")
    if problem := unwritable_file(a.out):
        p.error(f"--out {a.out} {problem}")
    try:
        class_names = read_classes(a.classes) if a.classes is not None else None
        shards = expand(a.shards, a.allow_pipe_urls)
        check_out(a.out, shards, a.classes, a.overwrite)
        scans = scan_shards(shards, label, a.workers)
        for scan in scans:
            scan.writer = writer_classes(scan.shard, label)
        bad = [s for s in scans if s.bad]
        if bad and (not a.skip_bad or len(bad) == len(scans)):
            lines = [f"BAD  {s.shard}: {s.bad}" for s in bad]
            what = "every shard is bad" if len(bad) == len(scans) else "pass --skip_bad to index the other shards"
            print("\n".join(lines) + f"\nerror: {len(bad)} of {len(scans)} shards are bad; {what} (no index written)",
                  file=sys.stderr)
            return 1
        index = build_index(scans, a.out, label, a.name or a.out.stem, " ".join(a.shards), class_names,
                            str(a.classes))
    except (IndexingError, InputError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    write_index(index, a.out)
    for s in bad:
        print(f"SKIP {s.shard}: {s.bad}")
    print(summary(index, a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
