"""The kit finds flash-attn-4's CUTLASS DSL when it was installed with `pip --target` (its `.pth` file,
which puts nvidia_cutlass_dsl/dsl_packages on sys.path, is read only in site directories): it puts
the folder on sys.path and PYTHONPATH itself, and leaves both alone where the DSL imports already."""
import importlib.util
import os
import sys

from tools.gpu_check import cutlass_dsl_on_path


def _hide_installed_dsl(monkeypatch) -> None:
    monkeypatch.setattr(sys, "path", [p for p in sys.path if "dsl_packages" not in p])
    for name in [m for m in sys.modules if m.split(".")[0] in ("cutlass", "nvidia_cutlass_dsl")]:
        monkeypatch.delitem(sys.modules, name)


def test_a_target_install_gets_its_dsl_packages_on_the_path(monkeypatch, tmp_path):
    _hide_installed_dsl(monkeypatch)
    (tmp_path / "nvidia_cutlass_dsl" / "dsl_packages" / "cutlass").mkdir(parents=True)
    (tmp_path / "nvidia_cutlass_dsl" / "__init__.py").write_text("")
    (tmp_path / "nvidia_cutlass_dsl" / "dsl_packages" / "cutlass" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", "/site")
    assert importlib.util.find_spec("cutlass") is None  # what a --target install on PYTHONPATH looks like
    folder = tmp_path / "nvidia_cutlass_dsl" / "dsl_packages"
    assert cutlass_dsl_on_path() == folder
    assert importlib.util.find_spec("cutlass").origin == str(folder / "cutlass" / "__init__.py")
    assert os.environ["PYTHONPATH"] == os.pathsep.join([str(folder), "/site"])
    assert cutlass_dsl_on_path() is None  # found now: nothing more added


def test_nothing_changes_without_the_dsl(monkeypatch):
    _hide_installed_dsl(monkeypatch)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if "site-packages" not in p])
    monkeypatch.setenv("PYTHONPATH", "/site")
    path = list(sys.path)
    assert cutlass_dsl_on_path() is None
    assert sys.path == path and os.environ["PYTHONPATH"] == "/site"
