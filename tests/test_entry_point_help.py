"""Every argparse entry point's --help: each option has a description, and each option with a
value shows its default. The config-driven ones
(pretrain, finetune, linprobe) are tests/train/config/test_options_help.py."""
import argparse
import importlib

import pytest

ENTRY_POINTS = ["train.evaluate", "train.export", "train.bench_objectives", "kernels.bench", "data.write_shards",
                "data.verify", "data.index_shards", "launchers.submit", "experiments.fashion_mnist.demo",
                "experiments.fashion_mnist.study", "experiments.fashion_mnist.report",
                "experiments.fashion_mnist.learned_masks", "experiments.fashion_mnist.homologous_attention",
                "experiments.fashion_mnist.segment_features", "tools.scaling", "tools.method_costs",
                "tools.method_time"]


def parsers_of(module_name: str, monkeypatch) -> list[argparse.ArgumentParser]:
    """The parsers (and sub-parsers) `main(['--help'])` builds, caught as it asks them to parse."""
    seen: list[argparse.ArgumentParser] = []

    def catch(self, args=None, namespace=None):
        seen.append(self)
        raise SystemExit(0)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", catch)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", catch)
    with pytest.raises(SystemExit):
        importlib.import_module(module_name).main(["--help"])
    assert seen, f"{module_name}.main builds no argparse parser"
    parsers = list(seen)
    for parser in seen:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                parsers += list(action.choices.values())
    return parsers


@pytest.mark.parametrize("module_name", ENTRY_POINTS)
def test_every_option_is_described_with_its_default(module_name, monkeypatch):
    for parser in parsers_of(module_name, monkeypatch):
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            name = "/".join(action.option_strings) or action.dest
            assert action.help and action.help != argparse.SUPPRESS, f"{module_name} {parser.prog}: {name} has no help"
            takes_value = action.nargs != 0
            # ArgumentDefaultsHelpFormatter (or a formatter of its own) appends every default itself
            shown_by_formatter = parser.formatter_class._get_help_string is not argparse.HelpFormatter._get_help_string
            if action.option_strings and takes_value and action.default not in (None, "", argparse.SUPPRESS) \
                    and not shown_by_formatter:
                assert "%(default)" in action.help or "default" in action.help, \
                    f"{module_name} {parser.prog}: {name} does not show its default ({action.default!r})"


def test_bench_help_lists_its_own_options_and_every_run_option(capsys):
    from train.bench import main

    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--loader_only" in out and "--steps N (20)" in out  # its own
    assert "--optim.blr float" in out and "--data.num_workers int" in out  # the run's, with types
