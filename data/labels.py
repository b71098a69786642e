"""Where a training sample's label is (data.label_key, an index's "label_key") and how it is read.

    cls          the `.cls` member: an integer as text (data/write_shards.py, ImageNet in webdataset form)
    json:label   the field `label` of the sample's `.json` member (img2dataset / LAION-style metadata);
                 any MEMBER:FIELD names a field of another JSON member the same way

A sample without its label is skipped as `missing_cls` (the member or the field is absent), one
whose label is not an integer as `bad_label` (data/faults.py). Shards without labels are read
without a LabelKey at all: their batches carry no "label" (data/shards.py).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from data.faults import SampleError

DEFAULT_LABEL_KEY = "cls"


@dataclass(frozen=True)
class LabelKey:
    """A sample's label: the text of `member`, or the JSON field `field` of `member`."""
    member: str = DEFAULT_LABEL_KEY
    field: str | None = None

    @classmethod
    def parse(cls, text: str) -> "LabelKey":
        """'cls', 'json:label', ...; ValueError for anything else. Members are matched lower-case, as
        webdataset groups them."""
        member, colon, name = text.partition(":")
        if not member or not member.replace("_", "").replace("-", "").isalnum() or (colon and not name):
            raise ValueError(f"label key {text!r}: expected MEMBER (e.g. cls) or MEMBER:FIELD (e.g. json:label)")
        return cls(member.lower(), name or None)

    def __str__(self) -> str:
        return self.member if self.field is None else f"{self.member}:{self.field}"

    def present(self, sample: dict) -> bool:
        """The member holding the label is there (its field is looked up by `read`)."""
        return self.member in sample

    def read(self, sample: dict) -> int:
        """The label of a sample that has the member; SampleError `missing_cls` / `bad_label`."""
        value = sample[self.member]
        if self.field is not None:
            try:
                doc = json.loads(value)
            except (TypeError, ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: nested too deep
                raise SampleError("bad_label", f"the {self.member} member is not JSON") from None
            if not isinstance(doc, dict) or self.field not in doc:
                raise SampleError("missing_cls", f"the {self.member} member has no field {self.field!r}")
            value = doc[self.field]
            if isinstance(value, (bool, float)):  # 1.0 or true are not class indices
                raise SampleError("bad_label", f"{self} {value!r} is not an integer")
        try:
            label = int(value)
        except (TypeError, ValueError):
            shown = value[:20] if isinstance(value, (bytes, str)) else value
            raise SampleError("bad_label", f"{shown!r} is not an integer") from None
        if label < 0:  # a class index; a negative one would index the logits from the end
            raise SampleError("bad_label", f"{label} is negative")
        return label
