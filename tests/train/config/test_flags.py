"""An entry point's own flags, taken out of its arguments before the run options are parsed."""
import pytest
from conftest import CPU_DS

from train.config.errors import ConfigError
from train.config.flags import pop_flags

FLAGS = {"--dry-run": None, "--world_size": int, "--gpu": str}


def test_flags_are_taken_out_typed_and_the_other_arguments_keep_their_order():
    argv = ["--ds_config", "a.json", "--dry-run", "--world_size", "4", "--optim.blr", "1e-3", "--gpu", "a100"]
    found, rest = pop_flags(argv, FLAGS)
    assert found == {"dry-run": True, "world_size": 4, "gpu": "a100"}
    assert rest == ["--ds_config", "a.json", "--optim.blr", "1e-3"]
    assert pop_flags(["--ds_config", "a.json"], FLAGS) == ({}, ["--ds_config", "a.json"])


@pytest.mark.parametrize("argv", [["--ds_config", "a.json", "--world_size"], ["--world_size"],
                                  ["--dry-run", "--world_size"]])
def test_a_value_flag_given_last_without_its_value_is_a_config_error(argv):
    with pytest.raises(ConfigError, match="^--world_size needs a value$"):
        pop_flags(argv, FLAGS)


def test_a_switch_given_last_needs_no_value():
    assert pop_flags(["--ds_config", "a.json", "--dry-run"], FLAGS) == ({"dry-run": True}, ["--ds_config", "a.json"])


def test_the_dry_run_with_world_size_and_no_value_exits_2_in_one_line(capsys):
    from train.pretrain import main
    from train.run.cli import cli

    with pytest.raises(SystemExit) as stop:
        cli(lambda: main(["--dry-run", "--ds_config", str(CPU_DS), "--world_size"]))
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and "--world_size needs a value" in err, err


@pytest.mark.parametrize("argv, message", [
    (["--dry_run", "--ds_config", "a.json"], r"^unknown option '--dry_run'; did you mean --dry-run\?$"),
    (["--ds_config", "a.json", "--wolrd_size", "4"], r"^unknown option '--wolrd_size'; did you mean --world_size\?$"),
    (["--world-size=4"], r"^unknown option '--world-size'; did you mean --world_size\?$"),
    (["--gpus", "a100"], r"^unknown option '--gpus'; did you mean --gpu\?$"),
])
def test_a_misspelt_flag_is_refused_naming_the_flag(argv, message):
    with pytest.raises(ConfigError, match=message):
        pop_flags(argv, FLAGS)


def test_run_options_and_their_misspellings_are_left_to_the_options_parser():
    """A run option, `--config` and `--local_rank` pass; so does a word closest to a run option
    (--optim.blrr: the options' parser names --optim.blr) and one close to nothing."""
    argv = ["--ds_config", "a.json", "--config", "p.json", "--local_rank=0", "--optim.blrr", "1", "--zzz", "2",
            "--data.num_workers", "-1"]
    assert pop_flags(argv, FLAGS) == ({}, argv)


def test_a_value_flag_followed_by_an_option_has_no_value_and_a_negative_number_is_a_value():
    with pytest.raises(ConfigError, match="^--world_size needs a value$"):
        pop_flags(["--world_size", "--gpu", "a100"], FLAGS)
    assert pop_flags(["--shift", "-1"], {"--shift": int}) == ({"shift": -1}, [])


@pytest.mark.parametrize("argv, message", [
    (["--dry_run", "--ds_config", str(CPU_DS)], "unknown option '--dry_run'; did you mean --dry-run?"),
    (["--ds_config", str(CPU_DS), "--hepl"], "unknown option '--hepl'; did you mean --help?"),
    (["--dry-run", "--ds_config", str(CPU_DS), "--world-size", "4"],
     "unknown option '--world-size'; did you mean --world_size?"),
])
def test_pretraining_refuses_a_misspelt_flag_naming_it_and_exits_2_in_one_line(argv, message, capsys):
    from train.pretrain import main
    from train.run.cli import cli

    with pytest.raises(SystemExit) as stop:
        cli(lambda: main(argv))
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and message in err, err
