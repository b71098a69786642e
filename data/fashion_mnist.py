"""Where Fashion-MNIST's four idx files come from: found, else downloaded and checked, else a clear error.

    python -m data.fashion_mnist [--dest runs/fashion-mnist] [--url URL]   # prints the folder it found or filled

`find_or_download()` returns the first folder that holds all four files (each gzipped or not):

1. /usr/share/datasets/fashion-mnist, Debian's package dataset-fashion-mnist (`apt-get install
   dataset-fashion-mnist`, as root);
2. the cache folder DEST (default runs/fashion-mnist in this repository; `make clean` removes it),
   where files may also be put by hand;
3. DEST after downloading the missing files from the dataset's published location, Zalando's
   http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/ (or a mirror: --url / FASHION_MNIST_URL).
   Each file is written under a temporary name, checked (size, the MD5 Zalando's README publishes
   and its SHA-256) and only then renamed; a file that fails the check is deleted, and the error
   names it. Files already checked stay, so a second run fetches only what is still missing.

When nothing is found and the download fails, FashionMNISTMissing says where to put the files and
the two ways to get them.

The sizes and SHA-256s come from Debian's package files: Debian ships Zalando's files with only their
gzip header rewritten (no file name, a 2020 time stamp; the same compressed data). With Zalando's header
restored (the file name, the 2017 time stamp) all four match the published MD5s, and the table holds
those files' sizes and SHA-256s. Debian's own .gz files therefore do not match this table; they are
used as they are, never checked against it.
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a script: our packages are at the repository root
    import sys
    from pathlib import Path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import hashlib
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path

from data.image_datasets import FASHION_MNIST_DIR, ShardError

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / "runs" / "fashion-mnist"
DEBIAN_DIR = FASHION_MNIST_DIR  # /usr/share/datasets/fashion-mnist
URL = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"
URL_ENV = "FASHION_MNIST_URL"  # a mirror holding the same four files
# file: (size in bytes, MD5 as Zalando's README publishes it, SHA-256)
FILES = {
    "train-images-idx3-ubyte.gz": (26421880, "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
                                   "3aede38d61863908ad78613f6a32ed271626dd12800ba2636569512369268a84"),
    "train-labels-idx1-ubyte.gz": (29515, "25c81989df183df01b3e8a0aad5dffbe",
                                   "a04f17134ac03560a47e3764e11b92fc97de4d1bfaf8ba1a3aa29af54cc90845"),
    "t10k-images-idx3-ubyte.gz": (4422102, "bef4ecab320f06d8554ea6380940ec79",
                                  "346e55b948d973a97e58d2351dde16a484bd415d4595297633bb08f03db6a073"),
    "t10k-labels-idx1-ubyte.gz": (5148, "bb300cfdad3c16e7a12a480ee83cd310",
                                  "67da17c76eaffca5446c3361aaab5c3cd6d1c2608764d35dfb1850b086bf8dd5"),
}
NETWORK_TIMEOUT = 60  # seconds, per connection attempt and per read


class FashionMNISTMissing(ShardError):
    """Neither folder holds the idx files and the download failed or was refused."""


def _holds(folder: Path, name: str) -> bool:
    """Whether `folder` holds the idx file `name`, gzipped or not."""
    return (folder / name).is_file() or (folder / name.removesuffix(".gz")).is_file()


def has_files(folder: Path) -> bool:
    """Whether `folder` holds all four idx files, each gzipped or not."""
    return all(_holds(folder, name) for name in FILES)


def _where_to_put(system: Path, dest: Path) -> str:
    names = ", ".join(FILES)
    return (f"Fashion-MNIST's idx files ({names}) are needed, gzipped or not, in {system} or {dest}. "
            f"Get them either way: (1) as root, `apt-get install dataset-fashion-mnist` (fills {DEBIAN_DIR}); "
            f"(2) download the four files from {URL} (MD5s in Zalando's README, "
            f"https://github.com/zalandoresearch/fashion-mnist) into {dest}. Then run this again.")


def _download(url: str, dest: Path, name: str) -> None:
    """`url` -> dest/name, written under a temporary name and renamed once size, MD5 and SHA-256 match."""
    size, md5, sha256 = FILES[name]
    tmp = dest / f".{name}.{os.getpid()}.part"  # one per process: two downloads at once do not mix
    got_md5, got_sha256, got = hashlib.md5(), hashlib.sha256(), 0
    try:
        with open(tmp, "wb") as out, urllib.request.urlopen(url, timeout=NETWORK_TIMEOUT) as response:
            while chunk := response.read(1 << 20):
                out.write(chunk)
                got_md5.update(chunk)
                got_sha256.update(chunk)
                got += len(chunk)
        if (got, got_md5.hexdigest(), got_sha256.hexdigest()) != (size, md5, sha256):
            raise FashionMNISTMissing(
                f"{url} does not match its checksums ({got} bytes, MD5 {got_md5.hexdigest()}, SHA-256 "
                f"{got_sha256.hexdigest()}; expected {size} bytes, MD5 {md5}, SHA-256 {sha256}): deleted it, "
                f"nothing was written to {dest / name}")
        os.replace(tmp, dest / name)
    finally:
        tmp.unlink(missing_ok=True)


def find_or_download(dest: Path | str | None = None, *, url: str | None = None, system: Path | None = None) -> Path:
    """The folder holding Fashion-MNIST's four idx files: `system` (default: Debian's package folder),
    else `dest` (default runs/fashion-mnist), downloading into it from `url` (default: $FASHION_MNIST_URL,
    else Zalando's) what it lacks. Raises FashionMNISTMissing, saying where to put the files."""
    system = DEBIAN_DIR if system is None else Path(system)
    dest = CACHE if dest is None else Path(dest)
    url = url or os.environ.get(URL_ENV) or URL
    url = url if url.endswith("/") else url + "/"
    for folder in (system, dest):
        if has_files(folder):
            return folder
    try:
        dest.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FashionMNISTMissing(f"cannot create {dest} ({e}). {_where_to_put(system, dest)}") from None
    for name in FILES:
        if _holds(dest, name):
            continue
        print(f"downloading {url}{name} -> {dest / name} ({FILES[name][0]:,} bytes)", file=sys.stderr, flush=True)
        try:
            _download(url + name, dest, name)
        except FashionMNISTMissing as e:
            raise FashionMNISTMissing(f"{e}. {_where_to_put(system, dest)}") from None
        except (OSError, urllib.error.URLError) as e:  # unreachable, refused, HTTP error, timeout, disk full
            reason = e if isinstance(e, urllib.error.HTTPError) else getattr(e, "reason", e)
            raise FashionMNISTMissing(
                f"could not download {url}{name}: {reason}. {_where_to_put(system, dest)}") from None
    return dest


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dest", type=Path, default=CACHE,
                   help="the cache folder: looked in after Debian's, and downloaded into (default: %(default)s)")
    p.add_argument("--url", default=None,
                   help=f"where the four .gz files are (default: ${URL_ENV} if set, else {URL})")
    a = p.parse_args(argv)
    try:
        folder = find_or_download(a.dest, url=a.url)
    except FashionMNISTMissing as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(folder)
    return folder


if __name__ == "__main__":
    main()
