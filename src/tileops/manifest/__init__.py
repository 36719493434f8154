"""The operator manifest: one YAML file per family, the single source of every op's spec.

Nothing else in the package parses the YAML; use `load_manifest`, `get_spec`,
`load_workloads` and `list_ops`. This package needs neither torch nor TileLang (the `tileops`
command's `list` reads it in a fraction of a second); nor does `spec.py`, which compiles an
entry into checks on tensors: torch's or its own light stand-ins (`ShapeTensor`).
"""

from __future__ import annotations

import functools
import pathlib
from typing import Any, NamedTuple

import yaml

from ..errors import ManifestError
from .schema import schema_errors

MANIFEST_DIR = pathlib.Path(__file__).parent
# libyaml's loader when PyYAML was built with it: several times faster than the pure-Python one
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def read_manifest_dir(directory: pathlib.Path) -> dict[str, dict[str, Any]]:
    """Reads every `<family>.yaml` in `directory` into {op name: entry}, checking the schema."""
    entries: dict[str, dict[str, Any]] = {}
    errors: list[ManifestError] = []
    for path in sorted(directory.glob("*.yaml")):
        try:
            with open(path) as f:
                data = yaml.load(f, Loader=_YAML_LOADER) or {}  # a safe loader, C or Python
        except yaml.YAMLError as e:
            raise ManifestError(f"{path.name}: not valid YAML: {_yaml_problem(e)}") from None
        if not isinstance(data, dict):
            raise ManifestError(f"{path.name}: expected a mapping of op name -> entry")
        for name, entry in data.items():
            if name in entries:
                errors.append(ManifestError(f"{name}: defined twice (second time in {path.name})"))
            errors.extend(schema_errors(name, entry))
            if isinstance(entry, dict) and entry.get("family") != path.stem:
                errors.append(ManifestError(
                    f"{name}: field 'family': expected '{path.stem}' (the file name), "
                    f"got {entry.get('family')!r}"))
            entries[name] = entry
    if errors:
        raise ManifestError("manifest is invalid:\n  " + "\n  ".join(map(str, errors)))
    return entries


def _yaml_problem(error: yaml.YAMLError) -> str:
    """PyYAML's error in one line: what and where (its own text spans several lines)."""
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    mark = getattr(error, "problem_mark", None)
    return f"{problem} (line {mark.line + 1}, column {mark.column + 1})" if mark else problem


@functools.cache
def load_manifest() -> dict[str, dict[str, Any]]:
    """All op entries of the shipped manifest, keyed by op class name."""
    return read_manifest_dir(MANIFEST_DIR)


def get_spec(op_name: str) -> dict[str, Any]:
    """The manifest entry of one op."""
    manifest = load_manifest()
    if op_name not in manifest:
        raise ManifestError(f"{op_name}: no such op in the manifest (known: {sorted(manifest)})")
    return manifest[op_name]


def load_workloads(op_name: str, tier: str | None = None) -> list[dict[str, Any]]:
    """The op's workloads; `tier='smoke'` keeps only those marked smoke."""
    workloads = get_spec(op_name).get("workloads", [])
    if tier == "smoke":
        workloads = [w for w in workloads if w.get("tier") == "smoke"]
    return workloads


class OpInfo(NamedTuple):
    """One manifest op, as `list_ops` returns it."""

    name: str      # the Op class name, e.g. 'RMSNormFwdOp'
    family: str    # e.g. 'normalization'
    status: str    # 'implemented' or 'spec-only'
    ref_api: str   # the API it mirrors, e.g. 'torch.nn.functional.rms_norm'


def list_ops(family: str | None = None, status: str | None = None) -> list[OpInfo]:
    """The manifest's ops, by family then name; reads the YAML only (no torch, no GPU).

    Args:
        family: only this family (e.g. 'attention').
        status: only this status ('implemented' or 'spec-only').
    """
    ops = [OpInfo(name, e["family"], e["status"], e["ref_api"])
           for name, e in load_manifest().items()]
    return sorted((op for op in ops if (family is None or op.family == family)
                   and (status is None or op.status == status)),
                  key=lambda op: (op.family, op.name))


def select_workloads(workloads: list[dict[str, Any]], texts: list[str] | None = None,
                     dtypes: list[str] | None = None) -> list[tuple[dict[str, Any], list[str]]]:
    """(workload, its dtypes among `dtypes`) for the workloads whose label contains one of
    `texts` (None: no filter), or equals it for a text starting with '=' (a label that is
    the start of another's); a workload left with no dtype drops out."""
    chosen = []
    for w in workloads:
        if texts and not any(w["label"] == text[1:] if text.startswith("=") else text in w["label"]
                             for text in texts):
            continue
        kept = [d for d in w["dtypes"] if not dtypes or d in dtypes]
        if kept:
            chosen.append((w, kept))
    return chosen


__all__ = ["load_manifest", "get_spec", "load_workloads", "select_workloads", "list_ops",
           "OpInfo", "read_manifest_dir", "MANIFEST_DIR"]
