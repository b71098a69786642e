"""data/fashion_mnist.py: where the idx files come from. Debian's folder first, then the cache folder,
then a download into it, checked against the checksum table, else an error that says where to put the
files. The "published location" here is a local HTTP server on 127.0.0.1 serving tiny fake idx
files whose checksums the tests put in the table: nothing is fetched from the internet (an autouse
fixture points the default URL at a closed local port)."""
from __future__ import annotations

import functools
import gzip
import hashlib
import http.server
import json
import threading

import pytest
from conftest import fake_fashion_mnist
from ports import free_port

from data import fashion_mnist as fm
from data.write_shards import main as write_shards

NAMES = list(fm.FILES)
PUBLISHED_URL = fm.URL  # before the autouse fixture replaces it


def closed_port_url() -> str:
    return f"http://127.0.0.1:{free_port()}/"  # nothing listens there once the socket is closed


@pytest.fixture(autouse=True)
def offline(tmp_path, monkeypatch):
    """No Debian folder, a cache folder under tmp_path, and a default URL nothing answers."""
    monkeypatch.setattr(fm, "DEBIAN_DIR", tmp_path / "debian")
    monkeypatch.setattr(fm, "CACHE", tmp_path / "cache")
    monkeypatch.setattr(fm, "URL", closed_port_url())
    monkeypatch.delenv(fm.URL_ENV, raising=False)


@pytest.fixture
def server(tmp_path, monkeypatch):
    """Tiny fake idx .gz files served over HTTP, their sizes and checksums in fm.FILES, the server's
    address as fm.URL; yields (url, served folder, list of requested paths)."""
    served = fake_fashion_mnist(tmp_path / "served", train=30, test=10)
    table = {}
    for name in NAMES:
        data = (served / name).read_bytes()
        table[name] = (len(data), hashlib.md5(data).hexdigest(), hashlib.sha256(data).hexdigest())
    monkeypatch.setattr(fm, "FILES", table)
    requests = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):  # quiet
            pass

        def do_GET(self):
            requests.append(self.path)
            super().do_GET()

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(served)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}/"
    monkeypatch.setattr(fm, "URL", url)
    yield url, served, requests
    httpd.shutdown()
    httpd.server_close()
    thread.join()


def test_download_fills_the_cache_with_checked_files_then_reuses_them(server):
    _, served, requests = server
    assert fm.find_or_download() == fm.CACHE
    assert sorted(requests) == sorted(f"/{n}" for n in NAMES)
    assert sorted(p.name for p in fm.CACHE.iterdir()) == sorted(NAMES)  # no temporary file left
    for name in NAMES:
        assert (fm.CACHE / name).read_bytes() == (served / name).read_bytes()
    assert fm.find_or_download() == fm.CACHE  # found: nothing fetched again
    assert len(requests) == len(NAMES)


def test_write_shards_without_src_downloads_into_the_cache(server, tmp_path, capsys):
    train, test = write_shards(["fashion-mnist", str(tmp_path / "out"), "--samples_per_shard", "8"])
    assert (train["num_samples"], test["num_samples"]) == (30, 10)
    assert json.loads((tmp_path / "out" / "test.json").read_text())["num_samples"] == 10
    assert fm.has_files(fm.CACHE)
    assert f"downloading {server[0]}train-images-idx3-ubyte.gz" in capsys.readouterr().err


def test_a_file_that_does_not_match_its_checksum_is_refused_and_deleted(server, monkeypatch):
    _, _, requests = server
    size, _, sha256 = fm.FILES[NAMES[0]]
    monkeypatch.setitem(fm.FILES, NAMES[0], (size, "0" * 32, sha256))  # the served file's MD5 differs
    with pytest.raises(fm.FashionMNISTMissing, match="does not match its checksums") as e:
        fm.find_or_download()
    assert "deleted it" in str(e.value) and str(fm.CACHE / NAMES[0]) in str(e.value)
    assert "apt-get install dataset-fashion-mnist" in str(e.value)
    assert list(fm.CACHE.iterdir()) == []  # neither the file nor its partial download
    assert requests == [f"/{NAMES[0]}"]  # gives up at the first bad file


def test_a_later_mismatch_keeps_the_files_already_checked(server, monkeypatch):
    bad = NAMES[2]
    size, md5, _ = fm.FILES[bad]
    monkeypatch.setitem(fm.FILES, bad, (size, md5, "0" * 64))  # the served file's SHA-256 differs
    with pytest.raises(fm.FashionMNISTMissing, match=bad):
        fm.find_or_download()
    assert sorted(p.name for p in fm.CACHE.iterdir()) == sorted(NAMES[:2])  # checked ones stay, no .part file


def test_an_unreachable_server_says_where_to_put_the_files(capsys):
    with pytest.raises(fm.FashionMNISTMissing) as e:
        fm.find_or_download()
    message = str(e.value)
    assert message.startswith(f"could not download {fm.URL}{NAMES[0]}")
    for where in (str(fm.DEBIAN_DIR), str(fm.CACHE), "apt-get install dataset-fashion-mnist",
                  f"download the four files from {fm.URL}", *NAMES):
        assert where in message
    assert list(fm.CACHE.iterdir()) == []
    # the same through write_shards (exit 2, the message on stderr) and the module's own CLI
    for cli in (lambda: write_shards(["fashion-mnist", str(fm.CACHE.parent / "out")]), lambda: fm.main([])):
        with pytest.raises(SystemExit) as exit_:
            cli()
        assert exit_.value.code == 2
        assert f"error: could not download {fm.URL}" in capsys.readouterr().err


def test_debians_folder_is_preferred_when_it_holds_all_four_files(server, tmp_path):
    _, _, requests = server
    fake_fashion_mnist(fm.CACHE, train=3, test=3)  # a complete cache too: Debian's still wins
    (fm.DEBIAN_DIR).mkdir()
    for name in NAMES[:3]:  # an incomplete Debian folder is passed over
        (fm.DEBIAN_DIR / name).write_bytes((fm.CACHE / name).read_bytes())
    assert fm.find_or_download() == fm.CACHE
    fake_fashion_mnist(fm.DEBIAN_DIR, train=3, test=3)
    assert fm.find_or_download() == fm.DEBIAN_DIR
    assert fm.main(["--dest", str(tmp_path / "elsewhere")]) == fm.DEBIAN_DIR
    assert requests == []


def test_files_put_in_the_cache_by_hand_are_used_gzipped_or_not(server):
    _, served, requests = server
    fm.CACHE.mkdir()
    for name in NAMES:  # uncompressed, under the names without .gz
        (fm.CACHE / name.removesuffix(".gz")).write_bytes(gzip.decompress((served / name).read_bytes()))
    assert fm.find_or_download() == fm.CACHE
    assert requests == []


def test_only_the_files_missing_from_the_cache_are_downloaded(server):
    _, served, requests = server
    fm.CACHE.mkdir()
    placed = {NAMES[0]: (served / NAMES[0]).read_bytes(),  # as published
              NAMES[1].removesuffix(".gz"): gzip.decompress((served / NAMES[1]).read_bytes())}  # unpacked by hand
    for name, data in placed.items():
        (fm.CACHE / name).write_bytes(data)
    assert fm.find_or_download() == fm.CACHE
    assert sorted(requests) == sorted(f"/{n}" for n in NAMES[2:])
    assert sorted(p.name for p in fm.CACHE.iterdir()) == sorted([*placed, *NAMES[2:]])
    assert all((fm.CACHE / name).read_bytes() == data for name, data in placed.items())


def test_a_mirror_from_the_environment_or_the_cli(server, monkeypatch, tmp_path, capsys):
    url, _, requests = server
    monkeypatch.setattr(fm, "URL", closed_port_url())  # the default answers nothing: only the mirror can
    monkeypatch.setenv(fm.URL_ENV, url.rstrip("/"))
    assert fm.find_or_download() == fm.CACHE
    monkeypatch.delenv(fm.URL_ENV)
    assert fm.main(["--dest", str(tmp_path / "other"), "--url", url]) == tmp_path / "other"
    assert capsys.readouterr().out.strip().endswith(str(tmp_path / "other"))
    assert len(requests) == 2 * len(NAMES)


def test_the_demo_writes_its_shards_from_downloaded_files_without_debians(server, tmp_path, monkeypatch):
    from experiments.fashion_mnist import common

    monkeypatch.setattr(common, "FASHION_MNIST_DIR", tmp_path / "no-debian")
    monkeypatch.setattr(common, "SHARDS", tmp_path / "shards")
    train, test = common.fashion_mnist_shards()
    assert (json.loads(train.read_text())["num_samples"], json.loads(test.read_text())["num_samples"]) == (30, 10)
    assert fm.has_files(fm.CACHE)


def test_the_demo_without_files_or_network_exits_saying_where_to_put_them(tmp_path, monkeypatch, capsys):
    from experiments.fashion_mnist import common, demo

    monkeypatch.setattr(common, "FASHION_MNIST_DIR", tmp_path / "no-debian")
    monkeypatch.setattr(common, "SHARDS", tmp_path / "shards")
    with pytest.raises(SystemExit) as e:
        demo.main(["--epochs", "1", "--out", str(tmp_path / "run")])
    *tried, err = capsys.readouterr().err.splitlines()  # the download it tried, then one line: the refusal
    assert e.value.code == 2 and err.startswith("error: ") and all(line.startswith("downloading ") for line in tried)
    assert "apt-get install dataset-fashion-mnist" in err and str(fm.CACHE) in err
    assert not (tmp_path / "shards").exists() and not (tmp_path / "run").exists()


def test_the_checksum_table_is_zalandos():
    """The published MD5s (Zalando's README) and the published location; the sizes and SHA-256s
    beside them were computed from the same files (an MD5 or SHA-256 mismatch is refused: tested above)."""
    assert {n: md5 for n, (_, md5, _) in fm.FILES.items()} == {
        "train-images-idx3-ubyte.gz": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
        "train-labels-idx1-ubyte.gz": "25c81989df183df01b3e8a0aad5dffbe",
        "t10k-images-idx3-ubyte.gz": "bef4ecab320f06d8554ea6380940ec79",
        "t10k-labels-idx1-ubyte.gz": "bb300cfdad3c16e7a12a480ee83cd310",
    }
    assert PUBLISHED_URL == "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"
