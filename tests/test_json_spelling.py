"""One JSON spelling (issue 26 point 3), checked on the syntax tree of `parity/`: a report's JSON document is its
method `to_dict()` (values spelled by `parity.compare.jsonvalues.json_safe`), so no module-level function named
`to_json`, `to_dict` or `to_json_text` may come back, no class has a method or alias of the other two names, and
every report dataclass has `to_dict` (its own or a base class's, e.g. `parity.bench.reports.JsonRecord`).

A report dataclass: a `@dataclass` class of `parity/` whose name ends in "Report", or one of OTHER_REPORTS; the
records that are no JSON document are NOT_DOCUMENTS, each with its reason. The planted sources at the end show that
each check can fail.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "parity"
PRINTER_NAMES = ("to_json", "to_dict", "to_json_text")   # the old module-level spellings
OTHER_METHODS = ("to_json", "to_json_text")                # the one method name is to_dict
OTHER_REPORTS = ("GateResult", "Comparison", "FullDepthResult", "SpecBenchResult", "SubopResult")
NOT_DOCUMENTS = {
    "ValidationReport": "the GGUF contract's problems (parity.gguf.inventory), printed as text by inspect",
    "FitReport": "fit_drafter's return value; the bench's JSON of a fit is parity.bench.spec_bench_report.FitSummary",
}


def _is_dataclass(node: ast.ClassDef) -> bool:
    def name(d: ast.expr) -> str:
        d = d.func if isinstance(d, ast.Call) else d
        return d.attr if isinstance(d, ast.Attribute) else d.id if isinstance(d, ast.Name) else ""
    return any(name(d) == "dataclass" for d in node.decorator_list)


def _base_names(node: ast.ClassDef) -> list[str]:
    return [b.attr if isinstance(b, ast.Attribute) else b.id for b in node.bases
            if isinstance(b, ast.Attribute | ast.Name)]


def _has_method(node: ast.ClassDef, method: str) -> bool:
    return any(isinstance(n, ast.FunctionDef) and n.name == method for n in node.body)


def _defined_names(node: ast.stmt) -> list[str]:
    """The names a module- or class-level statement defines: a function's, or an assignment's targets."""
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        return [node.name]
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
    return [t.id for t in targets if isinstance(t, ast.Name)]


def violations(sources: dict[str, str]) -> list[str]:
    """Every module-level printer function and every report dataclass without `to_dict`, as 'path:line: what'."""
    out, classes = [], {}
    trees = {path: ast.parse(text) for path, text in sources.items()}
    for path, tree in trees.items():
        for node in tree.body:
            out += [f"{path}:{node.lineno}: module-level function {name}() (make it the report's to_dict)"
                    for name in _defined_names(node) if name in PRINTER_NAMES]
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, []).append((path, node))
                out += [f"{path}:{n.lineno}: {node.name}.{name} (the JSON method is to_dict)" for n in node.body
                        for name in _defined_names(n) if name in OTHER_METHODS]

    def has_to_dict(name: str, seen: frozenset[str] = frozenset()) -> bool:
        return any(_has_method(n, "to_dict") or any(has_to_dict(b, seen | {name}) for b in _base_names(n)
                                                     if b not in seen and b in classes)
                   for _, n in classes.get(name, []))

    for name, defs in classes.items():
        is_report = (name.endswith("Report") or name in OTHER_REPORTS) and name not in NOT_DOCUMENTS
        for path, node in defs:
            if is_report and _is_dataclass(node) and not has_to_dict(name):
                out.append(f"{path}:{node.lineno}: report dataclass {name} has no to_dict()")
    return out


def _parity_sources() -> dict[str, str]:
    return {str(p.relative_to(ROOT.parent)): p.read_text() for p in sorted(ROOT.rglob("*.py"))}


def test_one_json_spelling_in_parity():
    assert violations(_parity_sources()) == []


def test_the_named_reports_and_exceptions_exist():
    """OTHER_REPORTS and NOT_DOCUMENTS name dataclasses that exist (so neither list goes stale)."""
    found = {n.name for text in _parity_sources().values() for n in ast.walk(ast.parse(text))
             if isinstance(n, ast.ClassDef) and _is_dataclass(n)}
    named = set(OTHER_REPORTS) | set(NOT_DOCUMENTS)
    assert named <= found, named - found


PLANTED = {
    "a.py": ("def to_json(report):\n    return {}\n\n\ndef render(report):\n    def to_dict(x):\n        return x\n\n\n"
             "to_json_text = render\n"),
    "b.py": ("from dataclasses import dataclass\n\n\n@dataclass(frozen=True)\nclass LostReport:\n    x: int\n\n\n"
             "class Base:\n    def to_dict(self):\n        return {}\n\n\n"
             "@dataclass\nclass KeptReport(Base):\n    x: int\n\n\n"
             "@dataclass\nclass GateResult:\n    y: int\n\n\nclass PlainReport:\n    pass\n\n\n"
             "class Aliased:\n    def to_dict(self):\n        return {}\n\n    to_json = to_dict\n"),
}


def test_planted_printers_and_reports_are_found():
    """A module-level to_json is found, and an alias to_json_text (a nested to_dict is not module-level); a report
    dataclass without to_dict is found, one inheriting it is not, a non-dataclass is not; a named report counts; a
    method alias to_json is found."""
    assert violations(PLANTED) == ["a.py:1: module-level function to_json() (make it the report's to_dict)",
                                   "a.py:10: module-level function to_json_text() (make it the report's to_dict)",
                                   "b.py:32: Aliased.to_json (the JSON method is to_dict)",
                                   "b.py:5: report dataclass LostReport has no to_dict()",
                                   "b.py:20: report dataclass GateResult has no to_dict()"]
