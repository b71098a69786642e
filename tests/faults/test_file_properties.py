"""Files that a crash, a full disk, another program or a hand may have changed are read with only
the outcomes their readers document, whatever they hold (hypothesis, a bounded number of examples):

- a shard index beside real shards: `ShardSet.from_index` gives a set whose every shard exists with
  a positive integer count, or ShardIndexError / InputError / FileNotFoundError (one line at the
  entry points); `check_scored_against` and `check_held_out` on two such sets raise ShardIndexError
  at most;
- a checkpoint tag's complete.json: `tag_problem` a problem string or None, `read_meta` a value or
  ValueError, `is_pinned` a bool, `latest_complete` the newest tag that passes (the tag before when
  the garbled one does not);
- a real shard's bytes flipped, cut or padded with garbage: `raw_samples` + `open_sample` and
  `verify_shard` count what is wrong (SampleError kinds, a truncated shard) and never read more
  samples than the tar holds;
- lines appended to a real metrics.jsonl: `metric_rows` / `read_metrics` give every record (a JSON
  object with an integer step) and count the other lines, `Reporter` keeps them through a resume.
"""
from __future__ import annotations

import io
import json
import math
import shutil
import tarfile
import tempfile
from collections import Counter
from pathlib import Path

import pytest
from conftest import png_bytes, run_pretrain
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from data.cli import InputError
from data.faults import ERROR_KINDS, SampleError, ShardIndexError
from data.labels import LabelKey
from data.shard_index import PipeShard, ShardSet, check_held_out, check_scored_against
from data.shards import open_sample, raw_samples
from data.verify import main as verify_main
from data.verify import verify_shard
from data.write_shards import main as write_shards
from train.engine.checkpoint import COMPLETE, LATEST, is_pinned, latest_complete, read_meta, tag_for, tag_problem
from train.engine.checkpoint import _meta_problem, verify_readable
from train.run.folder import Reporter, metric_rows, read_metrics

SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SHARD_NAMES = ["train-000000.tar", "train-000001.tar", "train-000002.tar"]
HELD_OUT_NAMES = ["test-000000.tar", "test-000001.tar", "test-000002.tar"]
# file names an index or a complete.json may hold that no writer of this repository writes
ODD_NAMES = ["", ".", "..", "../x.tar", "/", "sub/../train-000000.tar", "a" * 300, "a/" * 2100, "x\x00y.tar",
             "\ud800.tar", "pipe:cat train-000000.tar", "http://host/train-000000.tar", "/dev/null", "train.json"]
INDEX_KEYS = ["shards", "classes", "labeled", "label_key", "labels_seen", "file", "samples", "name", "num_samples"]
META_KEYS = ["step", "world_size", "config", "files", "crc32", "pinned", "zero_stage", "objective"]


def json_values(keys: list[str], names: list[str]) -> st.SearchStrategy:
    """Any JSON value; object keys mostly those a reader looks up, strings sometimes file names."""
    scalars = (st.none() | st.booleans() | st.integers() | st.integers(-2, 8) | st.floats() | st.text(max_size=6)
               | st.sampled_from(names))
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(keys) | st.text(max_size=4), inner, max_size=5), max_leaves=16)


INDEX_VALUES = json_values(INDEX_KEYS, SHARD_NAMES + ODD_NAMES)
CLASS_NAMES = st.lists(st.sampled_from(["cat", "dog", "eel"]) | st.text(max_size=3), max_size=4)


@st.composite
def plausible_indexes(draw) -> dict:
    """An index like one data/write_shards.py or data/index_shards.py writes; in about half of them a
    field replaced by any JSON value, dropped, or one odd entry."""
    files = draw(st.lists(st.sampled_from(SHARD_NAMES + HELD_OUT_NAMES), min_size=1, max_size=3, unique=True))
    index = {"shards": [{"file": f, "samples": draw(st.integers(1, 4))} for f in files], "classes": draw(CLASS_NAMES),
             "labeled": draw(st.booleans()), "label_key": draw(st.sampled_from(["cls", "json:label", "CLS"]))}
    if draw(st.booleans()):
        index["labels_seen"] = draw(st.lists(st.integers(-1, 5), max_size=4))
    damage = draw(st.sampled_from(["none", "none", "replace", "drop", "entry", "label_key"]))
    if damage == "replace":
        index[draw(st.sampled_from(INDEX_KEYS))] = draw(INDEX_VALUES)
    elif damage == "drop":
        index.pop(draw(st.sampled_from(INDEX_KEYS)), None)
    elif damage == "entry":
        index["shards"].append({"file": draw(st.sampled_from(ODD_NAMES + SHARD_NAMES)),
                                "samples": draw(st.integers(-1, 4) | INDEX_VALUES)})
    elif damage == "label_key":
        index["label_key"] = draw(st.sampled_from(["json:", ":x", "", "a b", "Ωmega", "cls:"]))
    return index


INDEX_TEXTS = (INDEX_VALUES | plausible_indexes()).map(json.dumps).map(str.encode) | st.binary(max_size=48)


@pytest.fixture(scope="module")
def shard_folder(tmp_path_factory) -> Path:
    """Two sets of 3 real shards of 2 samples (a PNG and its class each) written by data/write_shards.py,
    train.json and test.json."""
    root = tmp_path_factory.mktemp("shards")
    for c, name in enumerate(["cat", "dog", "eel"]):
        (root / "images" / name).mkdir(parents=True)
        for i in range(2):
            (root / "images" / name / f"{i}.png").write_bytes(png_bytes(c * 60 + i * 7, size=(8, 6)))
    for name in ("train", "test"):
        write_shards(["imagefolder", str(root / "images"), str(root / "out"), "--samples_per_shard", "2",
                      "--workers", "1", "--name", name])
    assert sorted(p.name for p in (root / "out").glob("*.tar")) == HELD_OUT_NAMES + SHARD_NAMES
    return root / "out"


def read_index(path: Path, allow_pipe_urls: bool) -> ShardSet | None:
    """The set an index describes, or None when it is refused the documented way (one line at the entry points)."""
    try:
        return ShardSet.from_index(path, allow_pipe_urls)
    except (ShardIndexError, InputError, FileNotFoundError) as e:
        assert str(e).strip()
        event(f"index refused: {type(e).__name__}")
        return None


def assert_usable(shards: ShardSet) -> None:
    """What a reader of a ShardSet relies on."""
    assert shards.files and len(shards.files) == len(shards.counts)
    for f, n in zip(shards.files, shards.counts):
        assert type(n) is int and n > 0
        assert isinstance(f, PipeShard) or (f.is_file() and f.stat().st_size > 0), f
    assert len({f.name for f in shards.files}) == len(shards.files)
    assert isinstance(shards.labeled, bool) and isinstance(shards.classes, tuple)
    assert isinstance(LabelKey.parse(shards.label_key), LabelKey)
    assert shards.labels_seen is None or all(type(y) is int for y in shards.labels_seen)
    assert all(type(y) is int for y in shards.possible_labels())


@SETTINGS
@given(text=INDEX_TEXTS, allow_pipe_urls=st.booleans())
@example(text=json.dumps({"shards": [{"file": "a" * 300, "samples": 1}], "classes": []}).encode(),
         allow_pipe_urls=False)  # a name longer than the OS allows: missing, not an OSError
@example(text=json.dumps({"shards": [{"file": "a/" * 2100, "samples": 1}], "classes": []}).encode(),
         allow_pipe_urls=False)  # a path longer than the OS allows
def test_a_shard_index_of_any_content_is_read_or_refused_the_documented_way(shard_folder, text, allow_pipe_urls):
    path = shard_folder / "fuzzed.json"
    path.write_bytes(text)
    shards = read_index(path, allow_pipe_urls)
    if shards is not None:
        event("index read")
        assert_usable(shards)


@pytest.mark.parametrize("name", ["a" * 300, "a/" * 2100], ids=["name too long", "path too long"])
def test_a_shard_named_longer_than_the_system_allows_is_missing(shard_folder, name):
    path = shard_folder / "long_name.json"
    path.write_text(json.dumps({"shards": [{"file": SHARD_NAMES[0], "samples": 2}, {"file": name, "samples": 2}],
                                "classes": ["cat", "dog", "eel"]}))
    with pytest.raises(FileNotFoundError, match=rf"^1 shard\(s\) listed in {path} are missing, e\.g\. \['"):
        ShardSet.from_index(path)


@SETTINGS
@given(test=plausible_indexes(), train=plausible_indexes() | st.just("train.json"))
def test_the_checks_of_an_evaluation_set_refuse_with_shard_index_error_only(shard_folder, test, train):
    (shard_folder / "test_fuzzed.json").write_text(json.dumps(test))
    if train != "train.json":
        (shard_folder / "train_fuzzed.json").write_text(json.dumps(train))
    sets = [read_index(shard_folder / name, False) for name in
            ("test_fuzzed.json", "train.json" if train == "train.json" else "train_fuzzed.json")]
    if None in sets:
        return
    for check in (check_scored_against, check_held_out):
        try:
            check(*sets, "--data.eval_index", "--data.train_index")
            event(f"{check.__name__}: passed")
        except ShardIndexError as e:
            assert str(e).strip()
            event(f"{check.__name__}: refused")


# --- a checkpoint tag's complete.json -----------------------------------------------------------------

@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    """A debug MAE run with complete tags of steps 1 and 2 (train/pretrain.py), `latest` naming step 2."""
    run = tmp_path_factory.mktemp("ckpt") / "run"
    run_pretrain(run, "--run.max_steps", "2", "--run.ckpt_every", "1", "--run.export", "false",
                 "--run.tensorboard", "false")
    assert (run / "checkpoints" / LATEST).read_text().strip() == tag_for(2)
    return run


META_VALUES = json_values(META_KEYS, ["model.safetensors", "state.pt", "rng_rank0.pt", "optim/.metadata",
                                      *ODD_NAMES])


@st.composite
def garbled_metas(draw, meta: dict) -> bytes:
    """The tag's own complete.json with one change: a field replaced or dropped, a file listed that is
    not there, a listed one dropped, its size or crc32 replaced; or none."""
    meta = json.loads(json.dumps(meta))
    listed = st.sampled_from(sorted(meta["files"]))
    damage = draw(st.sampled_from(["none", "replace", "harmless", "drop", "add file", "drop file", "size", "crc"]))
    if damage == "replace":
        meta[draw(st.sampled_from(META_KEYS))] = draw(META_VALUES)
    elif damage == "harmless":  # fields no check reads
        meta[draw(st.sampled_from(["pinned", "zero_stage", "objective", "note"]))] = draw(META_VALUES)
    elif damage == "drop":
        meta.pop(draw(st.sampled_from(META_KEYS)), None)
    elif damage == "add file":
        meta["files"][draw(st.sampled_from(ODD_NAMES) | st.text(max_size=4))] = draw(st.integers(-1, 1 << 20)
                                                                                      | META_VALUES)
    elif damage == "drop file":
        name = draw(listed)
        meta["files"].pop(name)
        meta["crc32"].pop(name, None)
    elif damage == "size":
        meta["files"][draw(listed)] = draw(st.integers(-1, 1 << 20) | META_VALUES)
    elif damage == "crc":
        meta["crc32"][draw(listed)] = draw(st.integers(0, (1 << 32) - 1) | META_VALUES)
    return json.dumps(meta).encode()


def complete_jsons(meta: dict) -> st.SearchStrategy:
    """complete.json files: mostly the tag's own with one change, else any JSON, any bytes, or the own cut short."""
    raw = json.dumps(meta).encode()
    cut = st.integers(0, len(raw)).map(lambda n: raw[:n])
    return st.one_of(garbled_metas(meta), garbled_metas(meta), META_VALUES.map(json.dumps).map(str.encode),
                     st.binary(max_size=48), cut)


def test_a_garbled_complete_json_gets_a_documented_outcome(trained_run, tmp_path_factory):
    root = tmp_path_factory.mktemp("tags") / "checkpoints"
    shutil.copytree(trained_run / "checkpoints", root)
    tag, before = root / tag_for(2), root / tag_for(1)
    good = (tag / COMPLETE).read_bytes()
    assert tag_problem(tag) is None and latest_complete(root) == tag

    @SETTINGS
    @given(data=complete_jsons(json.loads(good)))
    @example(data=json.dumps({**json.loads(good), "files": {**json.loads(good)["files"], "a" * 300: 1}}).encode())
    @example(data=json.dumps({**json.loads(good), "files": {**json.loads(good)["files"], "a/" * 2100: 1}}).encode())
    @example(data=json.dumps({**json.loads(good), "files": {**json.loads(good)["files"], "\ud800.tar": 1}}).encode())
    def garbled(data: bytes) -> None:
        (tag / COMPLETE).write_bytes(data)
        problem = tag_problem(tag)
        assert problem is None or (isinstance(problem, str) and problem)
        assert problem is None or problem.encode("utf-8")  # a message any log or terminal can write
        try:
            meta = read_meta(tag)
        except ValueError:
            meta = None
        assert isinstance(is_pinned(tag), bool)
        event("tag trusted" if problem is None else "tag refused")
        if problem is None:  # trusted: what a resume reads of it is there
            assert isinstance(meta, dict) and _meta_problem(meta) == ""
            if "files" in meta:
                verify_readable(tag)
        assert latest_complete(root) == (tag if problem is None else before)

    try:
        garbled()
    finally:
        (tag / COMPLETE).write_bytes(good)


@pytest.mark.parametrize("name", ["a" * 300, "a/" * 2100], ids=["name too long", "path too long"])
def test_a_complete_json_listing_a_file_named_longer_than_the_system_allows_fails_that_tag(trained_run, tmp_path,
                                                                                         name):
    root = tmp_path / "checkpoints"
    shutil.copytree(trained_run / "checkpoints", root)
    tag = root / tag_for(2)
    meta = json.loads((tag / COMPLETE).read_text())
    (tag / COMPLETE).write_text(json.dumps({**meta, "files": {**meta["files"], name: 1}}))
    assert tag_problem(tag) == f"{tag / name} is missing"
    assert latest_complete(root) == root / tag_for(1)  # the tag before is resumed


# --- a shard's bytes --------------------------------------------------------------------------------

MUTATIONS = st.lists(st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 1 << 16), st.integers(1, 255)),
    st.tuples(st.just("cut"), st.integers(0, 1 << 16)),
    st.tuples(st.just("insert"), st.integers(0, 1 << 16), st.binary(min_size=1, max_size=600)),
    st.tuples(st.just("zero"), st.integers(0, 1 << 16), st.integers(1, 1024)),
), min_size=1, max_size=3)


def mutated(data: bytes, mutations: list[tuple]) -> bytes:
    out = bytearray(data)
    for kind, at, *arg in mutations:
        at %= len(out) + 1
        if kind == "flip" and at < len(out):
            out[at] ^= arg[0]
        elif kind == "cut":
            del out[at:]
        elif kind == "insert":
            out[at:at] = arg[0]
        elif kind == "zero":
            out[at:at + arg[0]] = bytes(len(out[at:at + arg[0]]))
    return bytes(out)


def members_in(path: Path) -> int:
    """Regular members tarfile finds before it gives up: the most samples the file can hold."""
    found = 0
    try:
        with tarfile.open(path, mode="r:") as tar:
            for m in tar:
                found += m.isreg()
    except Exception:  # whatever stops tarfile: what it found by then is all a reader can find
        pass
    return found


def read_shard(path: Path) -> tuple[int, Counter]:
    """(samples read, problems by kind) as training reads one shard."""
    errors, read = Counter(), 0
    for sample in raw_samples([path], errors):
        read += 1
        try:
            open_sample(sample)
        except SampleError as e:
            assert e.kind in ERROR_KINDS
            errors[e.kind] += 1
    keys = [s["__key__"] for s in raw_samples([path], Counter(), with_data=False)]
    assert len(keys) == read  # a resume replays the same samples without their data
    return read, errors


REPORT_KINDS = {*ERROR_KINDS, "not_a_tar", "count_mismatch", "label_out_of_range"}


@SETTINGS
@given(mutations=MUTATIONS)
def test_a_damaged_shard_is_read_and_verified_counting_what_is_wrong(shard_folder, mutations):
    original = (shard_folder / SHARD_NAMES[0]).read_bytes()
    data = mutated(original, mutations)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / SHARD_NAMES[0]
        path.write_bytes(data)
        most = members_in(path)
        read, errors = read_shard(path)
        report = verify_shard(path, 2, num_classes=3)
    event(f"{read} samples read, verify: {'ok' if report.ok else 'bad'}")
    assert read <= most and errors["truncated_shard"] <= 1
    assert set(report.problems) <= REPORT_KINDS and report.samples <= most
    if data == original:
        assert read == 2 and not errors and report.ok, (errors, report)


def pax_shard(path: Path, pax_headers: dict[str, str]) -> Path:
    """A tar whose first member carries these pax headers (GNU sparse ones tarfile parses with int())."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in (("000000.png", png_bytes(5)), ("000000.cls", b"1")):
            info = tarfile.TarInfo(name)
            info.size, info.pax_headers = len(data), pax_headers if name.endswith("png") else {}
            tar.addfile(info, io.BytesIO(data))
    path.write_bytes(buf.getvalue())
    return path


def long_name_chain(path: Path, links: int) -> Path:
    """A tar whose first member is named by `links` GNU long-name headers in a row (tarfile reads each
    by recursing into the next)."""
    link = tarfile.TarInfo("././@LongLink")
    link.type, link.size = tarfile.GNUTYPE_LONGNAME, 11
    block = link.tobuf(tarfile.GNU_FORMAT) + b"000000.cls\0".ljust(512, b"\0")
    member = tarfile.TarInfo("000000.cls")
    member.size = 1
    path.write_bytes(block * links + member.tobuf(tarfile.GNU_FORMAT) + b"1".ljust(512, b"\0") + bytes(1024))
    return path


@pytest.mark.parametrize("make", [
    lambda p: pax_shard(p, {"GNU.sparse.map": "x"}),
    lambda p: pax_shard(p, {"GNU.sparse.size": "zz"}),
    lambda p: pax_shard(p, {"GNU.sparse.major": "1", "GNU.sparse.minor": "0"}),
    lambda p: long_name_chain(p, 1000),
], ids=["sparse map", "sparse size", "sparse 1.0", "1000 long names"])
def test_a_tar_whose_first_header_tarfile_cannot_parse_is_a_bad_shard_not_a_traceback(tmp_path, make, capsys):
    path = make(tmp_path / "bad-000000.tar")
    errors = Counter()
    assert list(raw_samples([path], errors)) == [] and errors == Counter(truncated_shard=1)
    report = verify_shard(path, 1)
    assert report.samples == 0 and report.problems == Counter(not_a_tar=1), report
    index = tmp_path / "bad.json"
    index.write_text(json.dumps({"shards": [{"file": path.name, "samples": 1}], "classes": ["a", "b"]}))
    assert verify_main([str(index), "--workers", "1"]) == 1
    out = capsys.readouterr().out
    assert f"BAD  {path}: not_a_tar (" in out and "0 of 1 shards good, 1 bad" in out, out
    from data.index_shards import main as index_main

    assert index_main([str(path), "--out", str(tmp_path / "indexed.json"), "--workers", "1"]) == 1  # bad shards
    err = capsys.readouterr().err
    assert path.name in err and "Traceback" not in err and not (tmp_path / "indexed.json").exists(), err


# --- metrics.jsonl ----------------------------------------------------------------------------------

NO_NEWLINE = st.characters(blacklist_characters="\n\r")
RECORDS = st.fixed_dictionaries({"step": st.integers(0, 10 ** 6)},
                                optional={"loss": st.floats(), "note": st.text(NO_NEWLINE, max_size=5)})
# a line json.dumps writes when it does not escape what is not ASCII (another program appending, say)
RECORD_LINES = RECORDS.map(lambda r: json.dumps(r, ensure_ascii=False))
NOT_RECORDS = (json_values(["step", "loss"], ["step"]).map(json.dumps) | st.text(NO_NEWLINE, max_size=12)
               | RECORD_LINES.map(lambda line: line[: len(line) // 2]) | st.just("\0\0\0"))
LINES = st.lists(RECORD_LINES | NOT_RECORDS, max_size=6)
BYTE_LINES = st.lists(st.binary(max_size=12).map(lambda b: b.replace(b"\n", b"").replace(b"\r", b"")), max_size=4)


def record(line: str) -> dict | None:
    try:
        row = json.loads(line)
    except (ValueError, RecursionError):
        return None
    return row if isinstance(row, dict) and type(row.get("step")) is int else None


@pytest.fixture(scope="module")
def real_metrics(trained_run) -> bytes:
    data = (trained_run / "metrics.jsonl").read_bytes()
    assert len(metric_rows(trained_run / "metrics.jsonl")[0]) == 2
    return data


@SETTINGS
@given(lines=LINES, byte_lines=BYTE_LINES, resume_step=st.integers(0, 3))
@example(lines=['{"step": 3, "note": "a\u2028b"}', '{"step": 4, "note": "\x85"}'], byte_lines=[], resume_step=5)
@example(lines=['{"step": 0, "loss": Infinity}', '{"step": 1, "note": [NaN]}'], byte_lines=[], resume_step=1)
@example(lines=['{"step": null}', '{"step": 2.0}', '{"step": true}'], byte_lines=[], resume_step=1)  # no int step
def test_metrics_lines_of_any_content_are_records_or_counted(real_metrics, lines, byte_lines, resume_step):
    appended = [line.encode("utf-8", "surrogatepass") for line in lines] + byte_lines
    texts = [b.decode("utf-8", "replace") for b in appended]
    expected = [r for r in map(record, texts) if r is not None]
    unreadable = [t for t in texts if record(t) is None]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "metrics.jsonl"
        path.write_bytes(real_metrics + b"".join(b + b"\n" for b in appended))
        rows, cut = metric_rows(path)
        old = len(rows) - len(expected)
        assert old == 2 and same(rows[old:], expected) and same(read_metrics(Path(tmp)), rows)
        assert len([t for t in unreadable if t.strip("\0").strip()]) <= cut <= len(unreadable)
        Reporter(Path(tmp), resume_step, 10, tensorboard=False, progress=False).close()
        kept, cut_after = metric_rows(path)
    if cut or any(r["step"] > resume_step for r in rows):  # rewritten: a non-finite value as null
        rows = [{k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in r.items()} for r in rows]
    assert cut_after == 0 and same(kept, [r for r in rows if r["step"] <= resume_step])


def same(a: list[dict], b: list[dict]) -> bool:
    """The same records (NaN equal to NaN, as json writes both)."""
    return json.dumps(a) == json.dumps(b)
