"""Strict values: the one set of rules for what an option (train/config/options.py) or a ds_config value
the engine reads (train/config/ds_keys.py) may hold.

Types are not coerced. In JSON (a preset, a ds_config) a boolean is `true` / `false`, an integer is
a JSON number whose value is whole (8, or 8.0 and 5e8 as DeepSpeed's examples write bucket sizes;
not 8.5, not "8", not true), a number is any finite JSON number but never a boolean, a string is a
JSON string. On the command line every value is text, so there "true" / "false" (in any case) are
the booleans, an integer is written in decimal or as a whole number in float notation (1e3 =
1000; 8.5 is refused), and a number is anything float() reads. NaN and infinities are refused
wherever a number is read. Ranges are intervals written as a reader would write them ("[0, 1)",
"(0, inf)", "[1, 65536]"), declared beside the value they bound.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

_INTERVAL = re.compile(r"^\s*([\[(])\s*([^,\s]+)\s*,\s*([^\]\)\s]+)\s*([\])])\s*$")


@dataclass(frozen=True)
class Interval:
    """A closed, open or half-open interval of numbers; its bounds as written ("inf" for none)."""
    lo: str
    hi: str
    lo_open: bool
    hi_open: bool

    @classmethod
    def parse(cls, text: str) -> Interval:
        m = _INTERVAL.match(text)
        if m is None or not float(m[2]) < float(m[3]):
            raise ValueError(f"{text!r} is not an interval such as '[0, 1)' or '(0, inf)'")
        return cls(m[2], m[3], m[1] == "(", m[4] == ")")

    def __contains__(self, x: float) -> bool:
        lo, hi = float(self.lo), float(self.hi)
        return (lo < x if self.lo_open else lo <= x) and (x < hi if self.hi_open else x <= hi)

    def __str__(self) -> str:
        """'> 0', '>= 1', or 'in [0, 1)' (the interval as written)."""
        if float(self.hi) == math.inf:
            return f"{'>' if self.lo_open else '>='} {self.lo}"
        return f"in {'(' if self.lo_open else '['}{self.lo}, {self.hi}{')' if self.hi_open else ']'}"


def shown(value: Any) -> str:
    """A value as its JSON spelling (strings in double quotes, true, null, 8.0, NaN)."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


KINDS = {bool: "true or false", int: "an integer", float: "a finite number", str: "a string"}


def from_json(kind: type, value: Any) -> Any:
    """`value` (as JSON gives it) as `kind` (bool, int, float, str), else ValueError saying what it
    must be; a whole float becomes an int where an int is meant, an int a float where a float is."""
    if kind is bool and isinstance(value, bool):
        return value
    if kind is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if kind is int and isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    if kind is str and isinstance(value, str):
        return value
    raise ValueError(f"must be {KINDS[kind]}, got {shown(value)}{_hint(kind, value)}")


def _hint(kind: type, value: Any) -> str:
    """How to write `value` as `kind` in JSON, where it is that value in another spelling."""
    if isinstance(value, str) and kind is not str:
        try:
            from_text(kind, value)
        except ValueError:
            return ""
        return ": write it without quotes"
    return ""


def from_text(kind: type, text: str) -> Any:
    """Command-line `text` as `kind`, else ValueError saying what it must be."""
    if kind is str:
        return text
    if kind is bool:
        if text.lower() in ("true", "false"):
            return text.lower() == "true"
        raise ValueError(f"must be true or false, got {shown(text)}")
    try:
        number = int(text) if kind is int and re.fullmatch(r"\s*[-+]?\d+\s*", text) else float(text)
    except ValueError:
        raise ValueError(f"must be {KINDS[kind]}, got {shown(text)}") from None
    if not math.isfinite(number):
        raise ValueError(f"must be a finite number, got {shown(text)}")
    if kind is int and not float(number).is_integer():
        raise ValueError(f"must be an integer, got {shown(text)}")
    return int(number) if kind is int else float(number)


def check_range(value: float, interval: Interval | None) -> None:
    """ValueError when `value` is not finite or lies outside `interval` (None: any finite number)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"must be a finite number, got {shown(value)}")
    if interval is not None and value not in interval:
        raise ValueError(f"must be {interval}, got {shown(value)}")
