"""`--help` of the config-driven entry points (pretrain, finetune, linprobe, bench): one line per
option, grouped by section, with its type, default, range (numbers: the interval its field
declares, train/config/values.py) and description.

The description of an option is the comment on its field's line in the config dataclass (the
same text a reader of the code sees; no second list to keep in step), so every field carries
one; allowed values are written there as `a | b | c`.
"""
from __future__ import annotations

import dataclasses
import inspect
import io
import textwrap
import tokenize
import typing
from functools import lru_cache
from typing import Any

from train.config.values import Interval


@lru_cache(maxsize=None)
def field_comments(cls: type) -> dict[str, str]:
    """Field name -> the comment on its line, for a dataclass and the dataclasses it derives from."""
    comments: dict[str, str] = {}
    for klass in reversed(cls.__mro__):  # a subclass's comment wins
        if not dataclasses.is_dataclass(klass) or klass is object:
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):  # defined where no source is kept (an interactive session)
            continue
        own = {f.name for f in dataclasses.fields(klass)}
        line_field: dict[int, str] = {}
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
        for i, tok in enumerate(tokens[:-1]):
            # `name: type = default  # comment` at the class body's indentation (4 spaces after dedent)
            if tok.type == tokenize.NAME and tok.start[1] == 4 and tok.string in own and tokens[i + 1].string == ":":
                line_field[tok.start[0]] = tok.string
        for tok in tokens:
            if tok.type == tokenize.COMMENT and tok.start[0] in line_field:
                comments[line_field[tok.start[0]]] = tok.string.lstrip("#").strip()
    return comments


def type_name(tp: Any) -> str:
    """int, float, str, bool, float,float (a tuple given comma-separated), or str|None."""
    origin = typing.get_origin(tp)
    if origin is tuple:
        return ",".join(type_name(a) for a in typing.get_args(tp))
    if origin is not None:  # Optional / Union
        return "|".join("none" if a is type(None) else type_name(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


def show_default(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    if value == "":
        return "''"
    return str(value)


def range_text(tp: Any, metadata: Any) -> str:
    """'in [0, 1)', '> 0', ... for a number (the range its field declares; 'finite' when none), '' otherwise."""
    numbers = (int, float)
    if tp not in numbers and not (typing.get_origin(tp) is tuple and set(typing.get_args(tp)) <= set(numbers)):
        return ""
    return str(Interval.parse(metadata["range"])) if "range" in metadata else "finite"


def option_lines(sections: dict[str, Any]) -> list[str]:
    """`sections`: '' (top-level options) or a section name -> its config instance at its defaults.
    One header per section, then one line per option: `--key TYPE  default X  RANGE  description`."""
    rows: list[tuple[str, str, str, str, str]] = []
    lines: list[str] = []
    for name, instance in sections.items():
        cls = type(instance)
        hints = typing.get_type_hints(cls)
        comments = field_comments(cls)
        section_rows = []
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]) or f.name == "sections":
                continue  # sections are listed on their own
            key = f"{name}.{f.name}" if name else f.name
            section_rows.append((key, type_name(hints[f.name]), show_default(getattr(instance, f.name)),
                                 range_text(hints[f.name], f.metadata), comments.get(f.name, "")))
        rows += section_rows
        lines.append(("" if not lines else "\n") + (f"{name}:" if name else "top level:"))
        lines += [None] * len(section_rows)  # filled once the column widths are known
    width = max(len(f"--{key} {tp}") for key, tp, *_ in rows)
    dwidth = max(len(default) for _, _, default, *_ in rows)
    rwidth = max(len(bounds) for *_, bounds, _ in rows)
    filled = iter(f"  {f'--{key} {tp}':<{width}}  default {default:<{dwidth}}  {bounds:<{rwidth}}  {text}".rstrip()
                  for key, tp, default, bounds, text in rows)
    return [next(filled) if line is None else line for line in lines]
