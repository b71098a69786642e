"""Reading the options of a command: `--key value` pairs over `--config` presets over the
dataclass defaults (train/config/options.py), each value read strictly as its field's type; unknown
keys are errors naming the closest valid key, and options set that nothing of the run would read
are refused (`check_read`). `--help`'s text is built here too.
"""
from __future__ import annotations

import dataclasses
import difflib
from typing import Any

from data.cli import is_option_word
from model.objectives import OBJECTIVES, list_objectives
from train.config.errors import ConfigError
from train.config.help import option_lines, show_default, type_name
from train.config.options import Option, PretrainConfig, check_values, option_value, options, valid_keys
from train.config.presets import DEFAULTS, IF_OBJECTIVE, PresetOptions, compose, load_preset
from train.config.values import shown


def _unknown(key: str) -> ConfigError:
    close = difflib.get_close_matches(key, valid_keys(), n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else "; run with --help to list the options"
    return ConfigError(f"unknown option {key!r}{hint}")


def _set(cfg: PretrainConfig, key: str, value: Any) -> None:
    *path, leaf = key.split(".")
    target = cfg
    for part in path:
        target = getattr(target, part)
    setattr(target, leaf, value)


def _flatten(d: dict, known: dict[str, Option], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and f"{prefix}{k}" not in known:
            out.update(_flatten(v, known, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _read_preset(path: str, known: dict[str, Option]) -> PresetOptions:
    """A --config file's options, defaults and if_objective sections, each value read as its type."""
    preset = load_preset(path)
    parts = {part: preset.pop(part, {}) for part in (DEFAULTS, IF_OBJECTIVE)}
    examples = {DEFAULTS: {"optim": {"blr": 1.5e-4}}, IF_OBJECTIVE: {"mae": {"decoder_dim": 32}}}
    for part, value in parts.items():
        sections = value.values() if part == IF_OBJECTIVE and isinstance(value, dict) else []
        if not isinstance(value, dict) or not all(isinstance(v, dict) for v in sections):
            raise ConfigError(f"preset --config {path}: {part!r} must be an object of options (e.g. "
                              f"{shown({part: examples[part]})}), got {shown(value)}")
    unknown = sorted(set(parts[IF_OBJECTIVE]) - set(OBJECTIVES))
    if unknown:
        raise ConfigError(f"preset --config {path}: {IF_OBJECTIVE!r} names {unknown}, which are not objectives; "
                          f"choose from {list_objectives()}")

    def read(options: dict) -> dict[str, Any]:
        out = {}
        for key, value in _flatten(options, known).items():
            if key not in known:
                raise _unknown(key)
            try:
                out[key] = known[key].read(value, text=False)
            except ValueError as e:
                raise known[key].refusal(key, e, path) from None
        return out

    return PresetOptions(path, read(preset), read(parts[DEFAULTS]),
                         {name: read({name: section}) for name, section in parts[IF_OBJECTIVE].items()})


def defaults_under(argv: list[str]) -> PretrainConfig:
    """The options as the `--config` presets of `argv` set them (e.g. fine-tuning's recipe), over
    the dataclass defaults, unchecked: the defaults a command's --help shows."""
    known = options()
    presets = [_read_preset(value, known) for key, value in _pairs(argv, known) if key == "config"]
    objective = compose(presets, set()).get("objective", (PretrainConfig.objective, ""))[0]
    cfg = PretrainConfig()
    for key, (value, _) in compose(presets, set(), objective).items():
        _set(cfg, key, value)
    return cfg


def help_text(cfg: PretrainConfig | None = None) -> str:
    """Every option, one line each, grouped by section: type, default (`cfg`'s value: a command's
    recipe; else the dataclass default), range, description (train/config/help.py)."""
    cfg = PretrainConfig() if cfg is None else cfg
    sections = {"": cfg, **{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
                            if dataclasses.is_dataclass(getattr(cfg, f.name))}, **cfg.sections}
    head = ["command options:",
            "  --config FILE         a JSON preset (train/configs/<method>/*.json); may be given several times, in any",
            "                        order: presets that set one option to different values are refused, and the",
            "                        --key value options win over every preset",
            "  --dry-run             check the configuration for --world_size N ranks on --gpu NAME (a100, h100, v100, ...)",
            "                        and estimate memory; starts nothing (train/estimate/dry_run.py)",
            "  --help, -h            this text",
            "",
            "options (--key value or --key=value; booleans true|false; integers also as 1e3; numbers finite and in",
            "the range shown):"]
    return "\n".join(head + option_lines(sections))


def _shards(cfg: PretrainConfig) -> bool:
    return cfg.data.source == "shards"


def _eval(cfg: PretrainConfig) -> bool:
    return bool(cfg.data.eval_index)


SHARDS = "--data.source shards"
# Options read only under a condition: option -> (the condition, what would read the option, whether
# a preset may set it unread: the condition is the data source, or the option is part of a recipe's
# pipeline, such as its evaluation crop). Objective sections are read by their objective only.
READ_ONLY_WHEN: dict[str, tuple[Any, str, bool]] = {
    **{f"data.{k}": (_shards, SHARDS, True) for k in (
        "train_index", "label_key", "num_workers", "shuffle_buffer", "crop_scale_min", "decode",
        "max_bad_fraction", "max_image_pixels", "verify_shards")},
    "data.allow_pipe_urls": (lambda c: _shards(c) or _eval(c), f"{SHARDS} or --data.eval_index", True),
    "data.randaug": (lambda c: _shards(c) and c.data.train_transform == "randaug",
                     "--data.source shards with --data.train_transform randaug", True),
    "data.reprob": (lambda c: _shards(c) and c.data.train_transform == "randaug",
                    "--data.source shards with --data.train_transform randaug", True),
    "data.num_crops": (lambda c: c.data.train_transform == "multicrop", "--data.train_transform multicrop", False),
    "data.num_classes": (lambda c: c.data.source == "synthetic", "--data.source synthetic (shards carry their "
                         "classes)", True),
    "data.eval_crop_pct": (_eval, "--data.eval_index", True),  # a probe recipe's scoring crop
    "run.eval_every": (_eval, "--data.eval_index", False),
}


def check_read(cfg: PretrainConfig, origins: dict[str, str], entry_point_reads_not: dict[str, str]) -> None:
    """Refuse an option set away from its default (on the command line or in a preset) that nothing
    of this run would read: another objective's section, a data option of the other source or
    transform, an option the command ignores (given on its command line). A preset may set options
    that depend on the data source and stay unread when the command line picks the other source
    (it describes its recipe's pipeline, its evaluation crop included), and sections under
    "if_objective" (applied to their objective only)."""
    default = PretrainConfig()
    for key, origin in origins.items():
        section, _, name = key.partition(".")
        value = option_value(cfg, key)
        if value == option_value(default, key):
            continue
        where = "on the command line" if origin == "command line" else f"by the preset {origin}"
        if key in entry_point_reads_not and origin == "command line":  # a preset describes a run, not a command
            raise ConfigError(f"--{key} (set {where}) is not read by this command: {entry_point_reads_not[key]}")
        if section in cfg.sections and section != cfg.objective:
            raise ConfigError(f"--{key} (set {where}) is read only by --objective {section}, and this run's "
                              f"objective is {cfg.objective}: add --objective {section}, or drop the option")
        if key in READ_ONLY_WHEN:
            condition, reader, by_source = READ_ONLY_WHEN[key]
            if not condition(cfg) and not (by_source and origin != "command line"):
                raise ConfigError(f"--{key} (set {where}) is read only with {reader}, which this run does not "
                                  f"have: add it, or drop the option")


def _pairs(argv: list[str], known: dict[str, Option]) -> list[tuple[str, str]]:
    """(key, value) of every `--key value` / `--key=value`; `--local_rank` (added by the deepspeed
    launcher) is left out. A `--key` whose next word is an option (`--` then a letter; -1 is a
    value) or that ends argv has no value: refused naming what it takes, or, for a key that is no
    option, the one meant."""
    pairs: list[tuple[str, str]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}; options are written --key value")
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(argv) or is_option_word(argv[i + 1]):
                raise _no_value(arg[2:], known)
            key, value = arg[2:], argv[i + 1]
            i += 2
        if key != "local_rank":
            pairs.append((key, value))
    return pairs


def _no_value(key: str, known: dict[str, Option]) -> ConfigError:
    """The refusal of `--key` given without its value: what the option takes and an example
    (`--run.overwrite` -> "--run.overwrite needs a value: true or false (e.g. --run.overwrite true)")."""
    if key == "config":
        return ConfigError("--config needs a value: a JSON preset (e.g. --config train/configs/mae/debug.json)")
    if key not in known:
        return _unknown(key)
    option = known[key]
    if option.type is bool:  # a switch is set by naming it: the example is the value that is not the default
        takes, example = "true or false", show_default(not option.default)
    elif option.type is str:  # its description lists its choices (e.g. "token (cls) | avg (...)")
        takes, example = option.text or "a string", option.default
    else:
        takes = type_name(option.type) + (f" {option.range}" if option.range is not None else "")
        example = show_default(option.default)
    return ConfigError(f"--{key} needs a value: {takes}" + (f" (e.g. --{key} {example})" if example else ""))


def parse_args(argv: list[str], entry_point_reads_not: dict[str, str] | None = None) -> PretrainConfig:
    """The options of `argv`: the dataclass defaults, under what the `--config` presets agree on
    (train/config/presets.py `compose`: their order does not matter), under the command line's
    `--key value` options. `entry_point_reads_not`: options the calling command does not read ->
    why (refused when set)."""
    known = options()
    command_line: dict[str, Any] = {}
    presets: list[PresetOptions] = []
    for key, value in _pairs(argv, known):
        if key == "config":
            presets.append(_read_preset(value, known))
            continue
        if key not in known:
            raise _unknown(key)
        try:
            command_line[key] = known[key].read(value, text=True)
        except ValueError as e:
            raise known[key].refusal(key, e) from None
    objective = command_line["objective"] if "objective" in command_line else \
        compose(presets, set(command_line)).get("objective", (PretrainConfig.objective, ""))[0]
    cfg = PretrainConfig()
    origins: dict[str, str] = {}
    for key, (value, path) in compose(presets, set(command_line), objective).items():
        _set(cfg, key, value)
        origins[key] = path
    for key, value in command_line.items():
        _set(cfg, key, value)
        origins[key] = "command line"
    check_values(cfg, origins)
    cfg.validate()
    check_read(cfg, origins, entry_point_reads_not or {})
    return cfg


def to_dict(cfg: PretrainConfig) -> dict:
    """Plain nested dict, as run folders and checkpoints store it: the common sections, then each
    objective's section as a top-level key (in registration order)."""
    out = dataclasses.asdict(cfg)
    out.update(out.pop("sections"))
    return out
