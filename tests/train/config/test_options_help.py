"""train/config/help.py: --help of the config-driven entry points lists every option on one line
with its type, default and the description written beside its field."""
import re

import pytest

from train.config.help import field_comments, option_lines
from train.config.options import PretrainConfig, valid_keys
from train.config.parsing import help_text


def option_rows() -> dict[str, list[str]]:
    rows: dict[str, list[str]] = {}
    for line in help_text().splitlines():
        m = re.match(r"  --(\S+) (\S+)\s+default (\S+)\s*(.*)$", line)
        if m:
            rows.setdefault(m.group(1), []).append(line)
    return rows


def test_every_option_has_one_line_with_type_default_and_description():
    rows = option_rows()
    keys = valid_keys()
    assert sorted(rows) == sorted(keys)  # every option, nothing else
    for key, lines in rows.items():
        assert len(lines) == 1, key
        _, tp, default, text = re.match(r"  --(\S+) (\S+)\s+default (\S+)\s*(.*)$", lines[0]).groups()
        assert text, f"--{key} has no description: write a comment on its field's line"
        assert tp in ("int", "float", "str", "bool", "float,float"), (key, tp)


def test_types_defaults_and_allowed_values_come_from_the_fields():
    rows = option_rows()
    assert rows["optim.blr"][0].split()[1:4] == ["float", "default", "0.00015"]
    assert rows["optim.betas"][0].split()[1:4] == ["float,float", "default", "0.9,0.95"]
    assert rows["run.tensorboard"][0].split()[1:4] == ["bool", "default", "true"]
    assert "auto (= sdpa) | sdpa | math | flash_attn" in rows["model.attn_backend"][0]
    assert "| fgsm" in rows["maeplus.adversary"][0]


def test_sections_are_grouped_and_the_command_flags_are_listed():
    text = help_text()
    for flag in ("--config FILE", "--dry-run", "--world_size", "--gpu", "--help"):
        assert flag in text.split("options (--key value")[0], flag
    headers = [line for line in text.splitlines() if re.fullmatch(r"[a-z_ ]+:", line)]
    cfg = PretrainConfig()
    assert headers[:6] == ["command options:", "top level:", "model:", "data:", "optim:", "run:"]
    assert headers[6:] == [f"{name}:" for name in cfg.sections]


def test_comments_are_read_from_the_class_body_and_its_bases():
    from dataclasses import dataclass

    @dataclass
    class Base:
        a: int = 1  # the a
        b: str = "x#y"  # b's text (a '#' inside the default is not a comment)

    @dataclass
    class Child(Base):
        c: float = 0.5  # the c
        a: int = 2  # the child's a

    assert field_comments(Child) == {"a": "the child's a", "b": "b's text (a '#' inside the default is not a comment)",
                                     "c": "the c"}
    lines = option_lines({"child": Child()})
    assert lines[0] == "child:"
    assert lines[1].split()[:4] == ["--child.a", "int", "default", "2"] and lines[1].endswith("the child's a")


@pytest.mark.parametrize("argv", [["--help"], ["-h"]])
def test_pretrain_help_prints_it(argv, capsys):
    import signal

    from train.pretrain import main

    handlers = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)}
    try:
        with pytest.raises(SystemExit) as e:
            main(argv)
    finally:  # main() installs its stop-signal handlers first
        for s, h in handlers.items():
            signal.signal(s, h)
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "model.attn_backend str" in out and "--dry-run" in out


@pytest.mark.parametrize("command, first_line, defaults", [
    ("finetune", "Fine-tuning with the MAE protocol", {"objective": "finetune", "optim.blr": "0.0005",
                                                       "optim.epochs": "100", "model.global_pool": "avg"}),
    ("linprobe", "Linear probe with the MAE protocol", {"objective": "linprobe", "optim.name": "lars",
                                                        "optim.blr": "0.1", "optim.epochs": "90"}),
])
def test_a_recipe_command_s_help_is_its_own_with_the_recipe_s_defaults(command, first_line, defaults, capsys):
    """finetune/linprobe --help printed pretraining's text, defaults and all (objective mae, blr
    1.5e-4, 800 epochs), though the command runs its recipe's."""
    import importlib
    import signal

    handlers = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)}
    try:
        with pytest.raises(SystemExit) as e:
            importlib.import_module(f"train.{command}").main(["--help"])
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith(first_line) and "Pretraining entry point" not in out
    shown = {m.group(1): m.group(2) for m in re.finditer(r"^  --([\w.]+) \S+ +default (\S+)", out, re.M)}
    assert {k: shown[k] for k in defaults} == defaults
