"""JSON schema of a manifest entry (checked with `jsonschema`, validator level L0)."""

from __future__ import annotations

from typing import Any

import jsonschema

from ..errors import ManifestError
from .spec import DTYPE_SIZES

_DTYPE_NAMES = list(DTYPE_SIZES)

_TENSOR = {
    "type": "object",
    "required": ["dtype"],
    "additionalProperties": False,
    "properties": {
        "dtype": {"type": "string", "minLength": 1},
        "shape": {"type": "string", "minLength": 1},
        "layout": {"type": "string"},
        "optional": {"type": "boolean"},
    },
}

_PARAM = {
    "type": "object",
    "required": ["type"],
    "additionalProperties": False,
    "properties": {"type": {"type": "string"}, "default": {}},
}

_WORKLOAD = {
    "type": "object",
    "required": ["label", "inputs", "dtypes"],
    "additionalProperties": False,
    "properties": {
        "label": {"type": "string", "minLength": 1},
        "inputs": {
            "type": "object",
            "additionalProperties": {
                "anyOf": [{"type": "array", "items": {"type": "integer", "minimum": 0}},
                          {"type": "null"}]
            },
        },
        "params": {"type": "object"},
        # values of inputs whose contents matter (cu_seqlens, a skewed routing bias); the rest
        # are random
        "data": {"type": "object",
                 "additionalProperties": {"type": "array", "items": {"type": "number"}}},
        "dtypes": {"type": "array", "minItems": 1, "items": {"enum": _DTYPE_NAMES}},
        "tier": {"enum": ["smoke", "full", "nightly"]},
    },
}

ENTRY_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["ref_api", "family", "status", "signature", "workloads", "roofline", "source"],
    "additionalProperties": False,
    "properties": {
        "ref_api": {"type": "string", "minLength": 1},
        "family": {"type": "string", "pattern": "^[a-z][a-z0-9_]*$"},
        "status": {"enum": ["spec-only", "implemented"]},
        "signature": {
            "type": "object",
            "required": ["inputs", "outputs"],
            "additionalProperties": False,
            "properties": {
                "inputs": {"type": "object", "minProperties": 1, "additionalProperties": _TENSOR},
                "outputs": {"type": "object", "minProperties": 1,
                            "additionalProperties": _TENSOR},
                "params": {"type": "object", "additionalProperties": _PARAM},
                "dims": {"type": "object", "additionalProperties": {"type": "string"}},
                "dtype_combos": {
                    "type": "array",
                    "items": {"type": "object", "additionalProperties": {"enum": _DTYPE_NAMES}},
                },
                "shape_rules": {"type": "array", "items": {"type": "string", "minLength": 1}},
                # the reference API's argument order, when it interleaves inputs and params
                "call_order": {"type": "array", "uniqueItems": True,
                               "items": {"type": "string", "minLength": 1}},
            },
        },
        "workloads": {"type": "array", "items": _WORKLOAD},
        "roofline": {
            "type": "object",
            "additionalProperties": False,
            "oneOf": [{"required": ["flops", "bytes"]}, {"required": ["func"]}],
            "properties": {
                "flops": {"type": "string"},
                "bytes": {"type": "string"},
                "func": {"type": "string", "pattern": r"^tileops\.perf\.formulas\.\w+$"},
            },
        },
        "source": {
            "type": "object",
            "required": ["op", "kernels", "test", "bench", "kernel_map"],
            "additionalProperties": False,
            "properties": {
                "op": {"type": "string"},
                "kernels": {"type": "array", "items": {"type": "string"}},
                "test": {"type": "string"},
                "bench": {"type": "string"},
                "kernel_map": {"type": "object", "additionalProperties": {"type": "string"}},
            },
        },
        "torch_compile": {"type": "boolean"},
        "autograd": {"type": "boolean"},
    },
}

OP_NAME_PATTERN = r"^[A-Z][A-Za-z0-9]*(Fwd|Bwd)Op$"

_validator = jsonschema.Draft202012Validator(ENTRY_SCHEMA)
# The repr of (name, entry) of the entries found clean: `tileops validate` checks the
# entries that loading the manifest checked a moment before, and jsonschema takes
# milliseconds per entry. (A repr tells lists from tuples and 1 from '1', as the schema does.)
_clean: set[str] = set()


def schema_errors(op_name: str, entry: Any) -> list[ManifestError]:
    """Every schema violation of one entry, each naming the op and the field path."""
    import re

    text = repr((op_name, entry))
    if text in _clean:
        return []
    errors = []
    if not re.match(OP_NAME_PATTERN, op_name):
        errors.append(ManifestError(
            f"{op_name}: op name: expected PascalCase ending in FwdOp or BwdOp"))
    for err in sorted(_validator.iter_errors(entry), key=lambda e: list(e.absolute_path)):
        field = ".".join(str(p) for p in err.absolute_path) or "<entry>"
        errors.append(ManifestError(f"{op_name}: field '{field}': {err.message}"))
    if not errors:
        _clean.add(text)
    return errors
