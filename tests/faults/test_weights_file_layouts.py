""".safetensors and torch files at the edges of their layouts: a file shorter than the header
length, a header nested too deep or not a table, tensors that leave a gap, tensors without values,
every safetensors dtype, torch.save's format from before PyTorch 1.6. The loader (safe_load) and
the shape reader (weights_shapes, the check before start) judge each alike."""
from __future__ import annotations

import struct

import pytest
import torch
from safetensors.torch import save_file
from test_weights_files import GOOD, _good_safetensors, _header_and_data, _with_header

from model.weights_reader import SAFETENSORS_BYTES, WeightsFileError, safe_load, weights_shapes

READERS = (safe_load, weights_shapes)


def assert_refused_alike(path, said: str) -> None:
    """Both readers refuse `path` with the same WeightsFileError, which names the file and matches `said`."""
    messages = []
    for read in READERS:
        with pytest.raises(WeightsFileError, match=said) as e:
            read(path)
        messages.append(str(e.value))
    assert messages[0] == messages[1] and str(path) in messages[0], messages


@pytest.mark.parametrize("size", range(1, 8))
def test_a_file_shorter_than_the_header_length_is_refused(size, tmp_path):
    """Fewer than the 8 bytes of the header length: nothing to unpack a length from."""
    path = tmp_path / "short.safetensors"
    path.write_bytes(bytes(range(1, size + 1)))
    assert_refused_alike(path, rf"is truncated or not a safetensors file: {size} bytes, fewer than the 8 of the header length")


def test_a_header_nested_too_deep_for_json_is_refused_as_not_json(tmp_path):
    """json raises RecursionError, not a ValueError, for arrays nested past Python's recursion limit."""
    deep = b"[" * 100_000
    path = tmp_path / "deep.safetensors"
    path.write_bytes(struct.pack("<Q", len(deep)) + deep)
    assert_refused_alike(path, r"is not a safetensors file: its 100000-byte header is not JSON \(RecursionError")


@pytest.mark.parametrize("header", [b"[1, 2, 3]", b"7", b'"tensors"', b"null"])
def test_a_header_of_json_other_than_a_table_is_refused(header, tmp_path):
    path = tmp_path / "list.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    assert_refused_alike(path, r"is not a safetensors file: its header is JSON but not a table of tensors")


def test_tensors_that_leave_a_gap_between_them_are_refused(tmp_path):
    """16 unclaimed bytes between 'a' (bytes 0-64 of the data) and 'b', the file's length
    otherwise consistent: safetensors' reader refuses such a file, so the check before start must."""
    header, data = _header_and_data(_good_safetensors(tmp_path / "good.safetensors"))
    a_end = header["a"]["data_offsets"][1]
    assert header["b"]["data_offsets"] == [a_end, a_end + 32]
    header["b"]["data_offsets"] = [a_end + 16, a_end + 48]
    path = tmp_path / "gap.safetensors"
    path.write_bytes(_with_header(header, data[:a_end] + bytes(16) + data[a_end:]))
    assert_refused_alike(path, rf"tensor 'b' starts at byte {a_end + 16} of the data, where the tensor before it ends at "
                         rf"{a_end} \(tensors overlap or leave a gap\)")


def test_a_tensor_without_values_loads(tmp_path):
    """A size of 0 is a size: (0, 3) spans no bytes and sits between its neighbours."""
    path = tmp_path / "empty_rows.safetensors"
    state = {**GOOD, "none": torch.zeros(0, 3)}
    save_file(state, str(path))
    assert weights_shapes(path) == {k: tuple(v.shape) for k, v in state.items()}
    loaded = safe_load(path)
    assert loaded["none"].shape == (0, 3) and all(torch.equal(loaded[k], v) for k, v in GOOD.items())


# safetensors' dtype names (its format's) -> the torch dtype it reads each as
TORCH_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                "BOOL": torch.bool, "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16,
                "C64": torch.complex64, "F8_E4M3": torch.float8_e4m3fn, "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
                "F8_E5M2": torch.float8_e5m2, "F8_E5M2FNUZ": torch.float8_e5m2fnuz}
def test_every_dtype_the_reader_knows_is_one_safetensors_writes():
    assert set(TORCH_DTYPES) == set(SAFETENSORS_BYTES)


@pytest.mark.parametrize("name", list(TORCH_DTYPES))
def test_a_tensor_of_each_dtype_reads_back_as_written(name, tmp_path):
    """The header's byte span of each tensor is judged by its dtype's size: a wrong size refuses a sound file."""
    dtype = TORCH_DTYPES[name]
    value = torch.arange(6).reshape(2, 3).remainder(2 if dtype == torch.bool else 6).to(dtype)
    path = tmp_path / f"{name}.safetensors"
    save_file({"w": value, "b": torch.ones(4)}, str(path))
    assert _header_and_data(path.read_bytes())[0]["w"]["dtype"] == name
    assert SAFETENSORS_BYTES[name] == value.element_size()
    assert weights_shapes(path) == {"w": (2, 3), "b": (4,)}
    loaded = safe_load(path)["w"]
    assert loaded.dtype == dtype and torch.equal(loaded.view(torch.uint8), value.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2,
                                   torch.float8_e5m2fnuz])
def test_a_float8_weight_holding_nan_is_refused_as_any_other(dtype, tmp_path):
    """torch has no isfinite for some float8 types: the check reads them widened to fp32."""
    value = torch.tensor([1.0, float("nan"), 2.0]).to(dtype)
    path = tmp_path / "w.safetensors"
    save_file({"w": value}, str(path))
    with pytest.raises(WeightsFileError, match=r"weight w holds 1 NaN or infinite value\(s\) of 3"):
        safe_load(path)


def test_a_torch_file_of_the_format_before_pytorch_1_6_is_read_alike(tmp_path):
    """torch.save's earlier pickle format cannot be memory-mapped: the shape reader reads it whole,
    as the loader does, rather than refusing a file the loader takes."""
    path = tmp_path / "legacy.pth"
    torch.save({"model": GOOD}, path, _use_new_zipfile_serialization=False)
    assert path.read_bytes()[:4] != b"PK\x03\x04"  # not the zip archive of PyTorch 1.6 and later
    assert weights_shapes(path) == {k: tuple(v.shape) for k, v in GOOD.items()}
    loaded = safe_load(path)["model"]
    assert loaded.keys() == GOOD.keys() and all(torch.equal(loaded[k], v) for k, v in GOOD.items())
