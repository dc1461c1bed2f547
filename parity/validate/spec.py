"""`ENGINE[:OPTS]` run specifications: `torch`, `torch:dtype=bfloat16`, `torch:act_quant=q8_0,fp8_kv=false`.

OPTS is `key=value,...` over the `RunOptions` fields a command line can set. Every key is checked: an unknown
key, a repeated key, a value of the wrong type or outside its choices is a `SpecError` naming it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from parity.contract.engine import NUMERICS_CHOICES, RunOptions
from parity.contract.errors import ParityError


class SpecError(ParityError):
    """An ENGINE:OPTS specification that does not parse."""


BOOLS = ("fp8_kv", "fp4_indexer")
CHOICES: dict[str, tuple[str, ...]] = {"dtype": ("float32", "float64", "bfloat16"), **NUMERICS_CHOICES}
STRINGS = ("device",)
FLOATS = ("cache_gb",)
SETTABLE = (*BOOLS, *CHOICES, *STRINGS, *FLOATS)
# The options that change numerics, with their exact value first (dtype: the exact path runs float32).
NUMERICS = {"dtype": "float32", **{k: v[0] for k, v in NUMERICS_CHOICES.items()}}


@dataclass(frozen=True)
class EngineSpec:
    """An engine name and the options given for it (only the keys written in the spec, in canonical order)."""

    engine: str
    given: tuple[tuple[str, str], ...]

    @property
    def options(self) -> RunOptions:
        return replace(RunOptions(), **{k: _value(k, v) for k, v in self.given})

    def text(self) -> str:
        """The canonical spec string (keys in RunOptions field order)."""
        return self.engine + (":" + ",".join(f"{k}={v}" for k, v in self.given) if self.given else "")

    def with_values(self, values: dict[str, str]) -> EngineSpec:
        """The same spec with `values` written explicitly (replacing or adding keys)."""
        merged = dict(self.given) | values
        return EngineSpec(self.engine, _canonical(merged))


def _value(key: str, raw: str) -> object:
    if key in BOOLS:
        if raw not in ("true", "false"):
            raise SpecError(f"option {key}={raw!r}: expected true or false")
        return raw == "true"
    if key in CHOICES:
        if raw not in CHOICES[key]:
            raise SpecError(f"option {key}={raw!r}: expected one of {', '.join(CHOICES[key])}")
        return raw
    if key in FLOATS:
        try:
            return float(raw)
        except ValueError:
            raise SpecError(f"option {key}={raw!r}: expected a number") from None
    return raw


def _canonical(given: dict[str, str]) -> tuple[tuple[str, str], ...]:
    order = [f.name for f in fields(RunOptions)]
    return tuple(sorted(given.items(), key=lambda kv: order.index(kv[0])))


def parse_spec(text: str) -> EngineSpec:
    """'ENGINE' or 'ENGINE:key=value,...' -> EngineSpec (values checked by building the RunOptions)."""
    engine, _, opts = text.partition(":")
    if not engine.strip() or engine != engine.strip():
        raise SpecError(f"engine spec {text!r}: expected ENGINE[:key=value,...]")
    given: dict[str, str] = {}
    for item in opts.split(",") if opts else []:
        key, eq, raw = item.partition("=")
        if not eq or not key or not raw:
            raise SpecError(f"engine spec {text!r}: {item!r} is not key=value")
        if key not in SETTABLE:
            raise SpecError(f"engine spec {text!r}: unknown option {key!r}; settable: {', '.join(SETTABLE)}")
        if key in given:
            raise SpecError(f"engine spec {text!r}: option {key!r} given twice")
        _value(key, raw)
        given[key] = raw
    spec = EngineSpec(engine, _canonical(given))
    spec.options  # noqa: B018  (RunOptions checks the combination)
    return spec


def numerics(spec: EngineSpec) -> dict[str, str]:
    """The value of every numerics option the spec runs with (given or the RunOptions default)."""
    opts = spec.options
    return {k: str(getattr(opts, k)) for k in NUMERICS}


def approx_keys(exact: EngineSpec, approx: EngineSpec) -> dict[str, str]:
    """Numerics options in which `approx` differs from `exact`: key -> the approx value."""
    a, e = numerics(approx), numerics(exact)
    return {k: a[k] for k in NUMERICS if a[k] != e[k]}


def explicit_exact(exact: EngineSpec, approx: EngineSpec) -> EngineSpec:
    """The approx spec with each of its approximate options written explicitly at the exact path's value
    (e.g. torch:act_quant=q8_0 vs torch -> torch:act_quant=none)."""
    e = numerics(exact)
    return approx.with_values({k: e[k] for k in approx_keys(exact, approx)})
