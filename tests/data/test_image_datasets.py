"""data/image_datasets.py: listing an image folder (sorted class order, a fixed class list) and
reading idx files, without writing shards (tests/data/test_write_shards.py writes them)."""
import gzip

import numpy as np
import pytest
from conftest import write_idx

from data.image_datasets import (
    DANGLING_LINK,
    NOT_AN_IMAGE_NAME,
    OUTSIDE_CLASS_FOLDERS,
    ImageFile,
    ShardError,
    left_out_summary,
    list_imagefolder,
    read_idx,
    read_loc_val_solution,
)


def test_imagefolder_classes_are_sorted_folder_names_and_files_sorted_within(image_folder):
    (image_folder / "ant").mkdir()
    (image_folder / "ant" / "b.png").write_bytes(b"checked later, by the shard's writer")
    (image_folder / "ant" / "a.png").write_bytes(b"")
    classes, files = list_imagefolder(image_folder)
    assert classes == ["ant", "cat", "dog", "eel"]
    assert files[:2] == [ImageFile(image_folder / "ant" / "a.png", 0), ImageFile(image_folder / "ant" / "b.png", 0)]
    assert [f.label for f in files] == [0, 0] + [1] * 8 + [2] * 8 + [3] * 8


def test_images_in_sub_folders_of_a_class_folder_take_that_class(image_folder):
    (image_folder / "dog" / "sub" / "deeper").mkdir(parents=True)
    (image_folder / "dog" / "sub" / "x.png").write_bytes(b"checked later, by the shard's writer")
    (image_folder / "dog" / "sub" / "deeper" / "y.png").write_bytes(b"")
    classes, files = list_imagefolder(image_folder)
    assert classes == ["cat", "dog", "eel"] and len(files) == 26
    assert ImageFile(image_folder / "dog" / "sub" / "x.png", 1) in files
    assert ImageFile(image_folder / "dog" / "sub" / "deeper" / "y.png", 1) in files


def test_a_given_class_list_fixes_indices_and_refuses_folders_outside_it(image_folder):
    classes, files = list_imagefolder(image_folder, ["zebra", "eel", "dog", "cat"])
    assert classes == ["zebra", "eel", "dog", "cat"] and {f.path.parent.name: f.label for f in files} == {
        "cat": 3, "dog": 2, "eel": 1}
    with pytest.raises(ShardError, match=r"1 class folder\(s\) .* are not among the 2 classes given.*'eel'"):
        list_imagefolder(image_folder, ["cat", "dog"])


def test_truncated_idx_is_rejected(tmp_path):
    write_idx(tmp_path / "x.gz", np.arange(4 * 28 * 28).reshape(4, 28, 28) % 256)
    assert read_idx(tmp_path / "x.gz")[3, 27, 27] == (4 * 28 * 28 - 1) % 256
    raw = gzip.open(tmp_path / "x.gz").read()
    with gzip.open(tmp_path / "y.gz", "wb") as f:
        f.write(raw[:-10])
    with pytest.raises(ShardError, match="truncated"):
        read_idx(tmp_path / "y.gz")


def test_loc_val_solution_maps_image_ids_to_their_first_wnid(tmp_path):
    csv = tmp_path / "LOC_val_solution.csv"
    csv.write_text("ImageId,PredictionString\nILSVRC2012_val_00000001,n01751748 33 90 466 324 n01751748 1 2 3 4\n")
    assert read_loc_val_solution(csv) == {"ILSVRC2012_val_00000001": "n01751748"}
    csv.write_text("id,label\nx,n01751748\n")
    with pytest.raises(ShardError, match="expected the columns ImageId,PredictionString"):
        read_loc_val_solution(csv)


def test_links_to_folders_are_followed_and_every_file_left_out_is_counted_by_reason(image_folder, tmp_path):
    """As torchvision's ImageFolder (os.walk(followlinks=True)): images in a linked sub-folder of a
    class are listed (a link back up is not followed twice); dangling links, non-image names and
    files beside the class folders are left out, each under its reason."""
    elsewhere = tmp_path / "more_dogs"
    elsewhere.mkdir()
    (elsewhere / "m.png").write_bytes(b"checked later")
    (image_folder / "dog" / "linked").symlink_to(elsewhere)
    (image_folder / "dog" / "loop").symlink_to(image_folder / "dog")  # a cycle: listed once
    (image_folder / "cat" / "gone.jpg").symlink_to(tmp_path / "nothing.jpg")
    (image_folder / "cat" / "notes.txt").write_text("x")
    (image_folder / "stray.jpg").write_bytes(b"")
    left_out = {}
    classes, files = list_imagefolder(image_folder, left_out=left_out)
    assert classes == ["cat", "dog", "eel"] and len(files) == 25
    assert ImageFile(image_folder / "dog" / "linked" / "m.png", 1) in files
    assert left_out == {OUTSIDE_CLASS_FOLDERS: [image_folder / "stray.jpg"],
                        DANGLING_LINK: [image_folder / "cat" / "gone.jpg"],
                        NOT_AN_IMAGE_NAME: [image_folder / "cat" / "notes.txt"]}
    line = left_out_summary(left_out)
    assert line.startswith("1 file(s) left out, lying beside the class folders, in none of them, e.g. ")
    assert f"; 1 file(s) left out, being symbolic links to nothing, e.g. {image_folder / 'cat' / 'gone.jpg'};" in line
