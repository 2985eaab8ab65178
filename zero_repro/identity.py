"""Which fields of a config identify a run point (records, reuse): the schema's field metadata
(``config.IDENTITY``, ``config.ABSENT``) read over ``Config``'s sections.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from zero_repro.config import ABSENT, IDENTITY, Config


def _identifies(f: dataclasses.Field) -> bool:
    return f.metadata.get(IDENTITY, True)


def _absent_value(f: dataclasses.Field) -> Any:
    if ABSENT in f.metadata:
        return f.metadata[ABSENT]
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def identity_fields() -> dict[str, list[dataclasses.Field]]:
    """{section: its identifying fields}, from the schema's field metadata."""
    return {sec.name: [f for f in dataclasses.fields(sec.default_factory) if _identifies(f)]
            for sec in dataclasses.fields(Config) if _identifies(sec)}


def identity(config: dict) -> dict[str, dict[str, Any]]:
    """The part of a resolved config (``summary``, or a record's ``config``, perhaps written
    by an older schema) that identifies a run point: every identifying field of today's
    schema, a field the config lacks at its ``ABSENT`` value; fields the schema no longer has
    are left out."""
    out = {}
    for sec, fields in identity_fields().items():
        have = config.get(sec) or {}
        out[sec] = {f.name: have[f.name] if f.name in have else _absent_value(f)
                    for f in fields}
    return out


