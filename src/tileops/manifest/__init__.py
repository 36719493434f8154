"""The operator manifest: one YAML file per family, the single source of every op's spec.

Nothing else in the package parses the YAML; use `load_manifest`, `get_spec` and
`load_workloads`.
"""

from __future__ import annotations

import functools
import pathlib
from typing import Any

import yaml

from ..errors import ManifestError
from .schema import schema_errors

MANIFEST_DIR = pathlib.Path(__file__).parent


def read_manifest_dir(directory: pathlib.Path) -> dict[str, dict[str, Any]]:
    """Reads every `<family>.yaml` in `directory` into {op name: entry}, checking the schema."""
    entries: dict[str, dict[str, Any]] = {}
    errors: list[ManifestError] = []
    for path in sorted(directory.glob("*.yaml")):
        with open(path) as f:
            data = yaml.safe_load(f) or {}
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


def select_workloads(workloads: list[dict[str, Any]], texts: list[str] | None = None,
                     dtypes: list[str] | None = None) -> list[tuple[dict[str, Any], list[str]]]:
    """(workload, its dtypes among `dtypes`) for the workloads whose label contains one of
    `texts` (None: no filter); a workload left with no dtype drops out."""
    chosen = []
    for w in workloads:
        if texts and not any(text in w["label"] for text in texts):
            continue
        kept = [d for d in w["dtypes"] if not dtypes or d in dtypes]
        if kept:
            chosen.append((w, kept))
    return chosen


__all__ = ["load_manifest", "get_spec", "load_workloads", "select_workloads",
           "read_manifest_dir", "MANIFEST_DIR"]
