"""data/cli.py: a path that must be a regular file is refused, without opening it, when it is
anything else."""
import os
import socket
import threading

import pytest

from data.cli import InputError, read_json, regular_file


def test_a_regular_file_and_a_link_to_one_pass(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    (tmp_path / "link").symlink_to(tmp_path / "weights.bin")
    assert regular_file(tmp_path / "weights.bin", "--encoder") == tmp_path / "weights.bin"
    assert regular_file(tmp_path / "link", "--encoder") == tmp_path / "link"


def test_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "weights.safetensors"
    os.mkfifo(fifo)
    outcome = []

    def check():
        try:
            regular_file(fifo, "--encoder", "give an exported encoder.safetensors")
        except InputError as e:
            outcome.append(str(e))

    worker = threading.Thread(target=check, daemon=True)
    worker.start()
    worker.join(timeout=10)  # opening the FIFO for reading would wait for a writer forever
    assert outcome == [f"--encoder {fifo} is a FIFO (named pipe), not a regular file: give an exported "
                       f"encoder.safetensors"]


@pytest.mark.parametrize("kind", ["folder", "device", "socket", "missing", "under a file", "dangling link"])
def test_what_is_not_a_regular_file_is_refused_saying_what_it_is(tmp_path, kind):
    (tmp_path / "a_file").write_text("x")
    path, said = {
        "folder": (tmp_path, "is a folder; give the file itself"),
        "device": ("/dev/null", "is a character device, not a regular file"),
        "socket": (tmp_path / "sock", "is a socket, not a regular file"),
        "missing": (tmp_path / "nowhere.json", "does not exist"),
        "under a file": (tmp_path / "a_file" / "x.json", "cannot be read (Not a directory)"),
        "dangling link": (tmp_path / "link", "does not exist"),
    }[kind]
    if kind == "socket":
        server = socket.socket(socket.AF_UNIX)
        server.bind(str(path))
    if kind == "dangling link":
        path.symlink_to(tmp_path / "gone")
    with pytest.raises(InputError) as refused:
        regular_file(path, "ds_config")
    assert str(refused.value).startswith(f"ds_config {path} {said}")


def test_read_json_refuses_a_fifo(tmp_path):
    os.mkfifo(tmp_path / "index.json")
    with pytest.raises(InputError, match="index.json is a FIFO"):
        read_json(tmp_path / "index.json", "shard index")


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000, '{"a": ' + '{"b": ' * 50_000 + "1" + "}" * 50_001])
def test_read_json_refuses_json_nested_too_deep_in_one_line(tmp_path, text):
    """json raises RecursionError, not a ValueError, for arrays or objects nested past Python's recursion limit."""
    (tmp_path / "preset.json").write_text(text)
    with pytest.raises(InputError) as refused:
        read_json(tmp_path / "preset.json", "--config")
    assert str(refused.value) == (f"--config {tmp_path / 'preset.json'} is nested too deep to be read as JSON "
                                  f"(arrays or objects inside one another past Python's recursion limit): "
                                  f"fix or replace the file")
