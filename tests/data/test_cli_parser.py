"""data/cli.py's Parser: argparse's errors as one line and exit 2, naming for each option it does
not know the one meant where one is close (every command built on it: evaluate, export, the
demo, the data tools)."""
import pytest

from data.cli import Parser, did_you_mean


def parser() -> Parser:
    p = Parser(prog="cmd")
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--format", choices=("timm", "transformers"), default="timm")
    p.add_argument("--max_train", type=int, default=0)
    p.add_argument("--shift", type=int, default=0)
    p.add_argument("--overwrite", action="store_true")
    return p


def refusal(p: Parser, argv: list[str], capsys) -> str:
    """The one line `p` prints for `argv`, after checking it exits 2."""
    with pytest.raises(SystemExit) as stop:
        p.parse_args(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1, err
    return err.strip()


@pytest.mark.parametrize("argv, line", [
    (["--checkpoint", "x", "--fromat", "timm"],
     "error: unrecognized arguments: --fromat timm; did you mean --format? (--help lists the options)"),
    (["--checkpoint", "x", "--max-train", "5"],  # '-' for '_'
     "error: unrecognized arguments: --max-train 5; did you mean --max_train? (--help lists the options)"),
    (["--checkpoint", "x", "--max-train=5"],
     "error: unrecognized arguments: --max-train=5; did you mean --max_train? (--help lists the options)"),
    (["--checkpoint", "x", "--fromat", "timm", "--overwite"],  # several: each named with its own
     "error: unrecognized arguments: --fromat timm --overwite; --fromat: did you mean --format?; --overwite: did you "
     "mean --overwrite? (--help lists the options)"),
    (["--checkpont", "x"],  # a required option misspelt: argparse says it is missing; the misspelling is named too
     "error: the following arguments are required: --checkpoint; --checkpont: did you mean --checkpoint? (--help "
     "lists the options)"),
    (["--checkpoint", "x", "--zzz", "1"], "error: unrecognized arguments: --zzz 1 (--help lists the options)"),
])
def test_an_unknown_option_is_refused_naming_the_one_meant(argv, line, capsys):
    assert refusal(parser(), argv, capsys) == line


def test_abbreviations_negative_numbers_and_words_after_a_bare_double_dash_are_not_misspellings(capsys):
    p = parser()
    p.add_argument("rest", nargs="*")
    a = p.parse_args(["--check", "x", "--shift", "-1", "--", "--fromat"])  # --check: argparse's abbreviation
    assert (a.checkpoint, a.shift, a.rest) == ("x", -1, ["--fromat"])
    assert refusal(p, ["--checkpoint", "x", "--format", "tim"], capsys) == \
        "error: argument --format: invalid choice: 'tim' (choose from 'timm', 'transformers') (--help lists the " \
        "options)"


def test_a_sub_command_names_its_own_options(capsys):
    p = Parser(prog="cmd")
    sub = p.add_subparsers(dest="kind", required=True)
    folder = sub.add_parser("folder")
    folder.add_argument("--samples_per_shard", type=int, default=1)
    assert refusal(p, ["folder", "--sampels_per_shard", "4"], capsys) == \
        "error: unrecognized arguments: --sampels_per_shard 4; did you mean --samples_per_shard? (--help lists the " \
        "options)"


def test_did_you_mean():
    names = ["--dry-run", "--world_size", "--gpu", "--help"]
    assert did_you_mean("--dry_run", names) == "--dry-run"
    assert did_you_mean("--wolrd_size", names) == "--world_size"
    assert did_you_mean("--hlep", names) == "--help"
    assert did_you_mean("--steps", names) is None


def test_did_you_mean_treats_dashes_and_underscores_alike():
    # --dry_run is --dry-run spelt with '_': that, not a name one letter away
    assert did_you_mean("--dry_run", ["--dry-run", "--dry_rus"]) == "--dry-run"
    # however many '-' for '_': still the same name
    assert did_you_mean("--x-y-z-w", ["--x_y_z_w"]) == "--x_y_z_w"


def test_an_accepted_abbreviation_gets_no_suggestion_beside_a_misspelt_option(capsys):
    """--check is argparse's abbreviation of --checkpoint: only --fromat is named as unknown."""
    assert refusal(parser(), ["--check", "x", "--fromat", "timm"], capsys) == \
        "error: unrecognized arguments: --fromat timm; did you mean --format? (--help lists the options)"


def test_words_after_a_bare_double_dash_get_no_suggestion(capsys):
    """After `--` every word is a positional value: --overwite there is no misspelt option."""
    p = parser()
    p.add_argument("rest", nargs="*")
    assert refusal(p, ["--checkpoint", "x", "--format", "tim", "--", "--overwite"], capsys) == \
        "error: argument --format: invalid choice: 'tim' (choose from 'timm', 'transformers') (--help lists the " \
        "options)"
