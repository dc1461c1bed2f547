"""`JsonRecord`, the base of every typed result of `v4parity bench`, and its readers.

A record is frozen, one field per JSON key (in the order the file holds them); `to_dict()` is the JSON document
(`parity.compare.jsonvalues.json_safe`), `from_dict` reads a stored one (refusing a missing or unknown key by name).
The performance tables (`parity.bench.perf_report.PerfReport`, OUT/bench.json), the verdict benchmark
(`parity.bench.verdicts_report.VerdictsReport`, OUT/verdicts.json), the full-depth and the spec-acceptance results
(`parity.bench.full_depth_report`, `parity.bench.spec_bench_report`) are records typed all the way down, built by
their benchmarks where the numbers are measured and printed from the records.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, fields, is_dataclass
from enum import Enum
from typing import Any, ClassVar

from parity.compare.jsonvalues import json_safe
from parity.contract.errors import ParityError


class JsonRecord:
    """A frozen record read from and written as its JSON document (one field per key, in file order).

    Class settings: OPTIONAL: keys the document may lack (None here, left out of `to_dict`); NESTED: field -> how
    its document value is read (a record's `from_dict`, `each(...)`, `values(...)`, an enum); KEYS: field -> its
    JSON key where the two differ ("cls" -> "class"); SPLICED: fields holding a record whose keys sit in this
    document itself (present together or absent: None). A scalar field (int, float, str, bool, list, dict, or
    those or None) is checked against its annotation."""

    OPTIONAL: ClassVar[tuple[str, ...]] = ()
    NESTED: ClassVar[Mapping[str, Callable[[Any], Any]]] = {}
    KEYS: ClassVar[Mapping[str, str]] = {}
    SPLICED: ClassVar[Mapping[str, type[JsonRecord]]] = {}

    @classmethod
    def _key(cls, name: str) -> str:
        return cls.KEYS.get(name, name)

    @classmethod
    def json_keys(cls) -> tuple[str, ...]:
        """The document's keys, in file order (a spliced record's keys in its place)."""
        return tuple(k for f in fields(cls)  # type: ignore[arg-type]
                     for k in (cls.SPLICED[f.name].json_keys() if f.name in cls.SPLICED else (cls._key(f.name),)))

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> Any:
        """The record of a document: every key a field (ParityError naming unknown and missing keys, a scalar of
        another type, a null where none may be)."""
        if not isinstance(doc, Mapping):
            raise ParityError(f"{cls.__name__}: expected a JSON object, not {type(doc).__name__}")
        keys = cls.json_keys()
        unknown = [k for k in doc if k not in keys]
        own = [cls._key(f.name) for f in fields(cls) if f.name not in cls.SPLICED]  # type: ignore[arg-type]
        missing = [k for k in own if k not in doc and k not in cls.OPTIONAL]
        if unknown or missing:
            raise ParityError(f"{cls.__name__}: unknown key(s) {unknown}, missing key(s) {missing}")
        values = {}
        for f in fields(cls):  # type: ignore[arg-type]
            if f.name in cls.SPLICED:
                rec = cls.SPLICED[f.name]
                part = {k: doc[k] for k in rec.json_keys() if k in doc}
                values[f.name] = rec.from_dict(part) if part else None
                continue
            key = cls._key(f.name)
            values[f.name] = _read(cls, key, str(f.type), cls.NESTED.get(f.name), doc.get(key))
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """The JSON document (file order; absent optional keys and spliced records left out; values spelled by
        `json_safe`)."""
        out: dict[str, Any] = {}
        for f in fields(self):  # type: ignore[arg-type]
            v = getattr(self, f.name)
            if f.name in self.SPLICED:
                out.update(v.to_dict() if v is not None else {})
            elif not (f.name in self.OPTIONAL and v is None):
                out[self._key(f.name)] = _document(v)
        return json_safe(out)


_SCALARS: dict[str, tuple[type, ...]] = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,)}
_NON_FINITE = ("inf", "-inf", "nan")   # how `json_safe` spells a non-finite float


def _read(cls: type, key: str, annotation: str, read: Callable[[Any], Any] | None, v: Any) -> Any:
    """One document value of `cls.key`, checked against its annotation and read by `read` (when given)."""
    nullable = annotation.endswith(" | None")
    if v is None:
        if not nullable:
            raise ParityError(f"{cls.__name__}: {key} is null (expected {annotation})")
        return None
    if read is not None:
        try:
            return read(v)
        except ParityError as e:
            raise ParityError(f"{cls.__name__}.{key}: {e}") from None
    base = annotation.removesuffix(" | None").split("[")[0]
    want = _SCALARS.get(base) or {"list": (list, tuple), "dict": (Mapping,)}.get(base)
    wrong = want is not None and (not isinstance(v, want) or (isinstance(v, bool) and base in ("int", "float")))
    if wrong and not (base == "float" and v in _NON_FINITE):
        raise ParityError(f"{cls.__name__}: {key} must be {annotation}, not {type(v).__name__} ({v!r})")
    return v


def _document(v: Any) -> Any:
    """A field value as JSON-shaped data: records by their `to_dict`, other dataclasses field by field."""
    if isinstance(v, JsonRecord):
        return v.to_dict()
    if is_dataclass(v) and not isinstance(v, type):
        return asdict(v)
    if isinstance(v, dict):
        return {k: _document(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_document(x) for x in v]
    return v


def each(read: Callable[[Any], Any]) -> Callable[[Any], list[Any]]:
    """Reads a JSON array element by element."""
    def go(v: Any) -> list[Any]:
        if not isinstance(v, (list, tuple)):
            raise ParityError(f"expected a JSON array, not {type(v).__name__}")
        return [read(x) for x in v]
    return go


def values(read: Callable[[Any], Any]) -> Callable[[Any], dict[str, Any]]:
    """Reads a JSON object's values one by one (keys kept, in order)."""
    def go(v: Any) -> dict[str, Any]:
        if not isinstance(v, Mapping):
            raise ParityError(f"expected a JSON object, not {type(v).__name__}")
        return {k: read(x) for k, x in v.items()}
    return go


def one_of(enum: type[Enum]) -> Callable[[Any], Any]:
    """Reads an enum's value (ParityError naming the allowed values)."""
    def go(v: Any) -> Any:
        try:
            return enum(v)
        except ValueError:
            raise ParityError(f"{v!r} is not one of {[m.value for m in enum]}") from None  # type: ignore[attr-defined]
    return go


def as_tuple(v: Any) -> tuple[Any, ...]:
    """Reads a JSON array into a tuple."""
    return tuple(each(lambda x: x)(v))


def plain_record(cls: type) -> Callable[[Any], Any]:
    """Reads a plain (non-JsonRecord) dataclass from its `asdict` document: exactly its fields."""
    def go(v: Any) -> Any:
        names = [f.name for f in fields(cls)]
        if not isinstance(v, Mapping) or sorted(v) != sorted(names):
            raise ParityError(f"{cls.__name__}: expected exactly the keys {names}, got {v!r}")
        return cls(**v)
    return go
