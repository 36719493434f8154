"""The validator behind `tileops validate`: fails when the code and the manifest disagree.

Levels, per manifest entry:

- L0: the entry matches the schema and compiles into a `CompiledSpec`.
- L1: an `implemented` entry has its Op class, whose `__init__` keyword-only params and
  `forward` inputs match the manifest names, order and defaults, and whose `kernel_map`
  matches `source.kernel_map`.
- L2: every workload names only manifest inputs and params and satisfies the shape rules
  (checked on the given manifest, then through the Op's own `check`).
- L3: the Op accepts exactly the declared dtypes (meta tensors, no GPU).
- L4: the roofline evaluates to finite non-negative integers on every workload and dtype.
- Plus: source paths exist, workload labels are unique, >= 2 workloads per implemented op.

The checks run in two stages. The manifest level (L0, L2 on the manifest's shape rules, L4,
labels, source paths) reads the manifest alone and imports neither torch nor TileLang: the
workloads' tensors are `ShapeTensor` stand-ins. The code level (L1, L2 through the Op's own
`check`, L3) needs the Op classes, and with them torch and TileLang (seconds to import).
`validate` runs both; `Validation` runs them one at a time, so that `tileops validate`
reports the first verdict before it pays for the imports.

`validate` compares the manifest dict it is *given* against the code, so a damaged copy of
the manifest or a stand-in class shows what the validator catches. Stand-ins only need the
attributes L1 reads (`__init__`, `forward`, `kernel_map`); the code-level L2/L3 checks run
only for classes that have a `check` method.
"""

from __future__ import annotations

import inspect
import math
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

from .errors import ManifestError, TileOpsError, TileOpsTypeError
from .manifest import load_manifest
from .manifest.schema import schema_errors
from .manifest.spec import CompiledSpec, ShapeTensor

# The dtypes L3 probes: the ones TileOPs kernels use plus an integer type no float op accepts.
L3_PROBE_DTYPES = ("float16", "bfloat16", "float32", "float8_e4m3fn", "int32")

# Constructor params every Op has besides the manifest params.
_OP_OWN_PARAMS = ("kernel_map", "tune")

_PACKAGE_DIR = pathlib.Path(__file__).resolve().parent


class ValidationResult(list[ManifestError]):
    """The errors found (a plain list of `ManifestError`s) plus informational `notes`.

    Notes say what was not checked and why; they never make validation fail.
    """

    def __init__(self, errors: Sequence[ManifestError] = (), notes: Sequence[str] = ()):
        super().__init__(errors)
        self.notes: list[str] = list(notes)


def default_repo_root() -> pathlib.Path | None:
    """The repository root when running from a source checkout (editable install), else None."""
    root = _PACKAGE_DIR.parents[1]
    if (root / "src" / "tileops").resolve() == _PACKAGE_DIR and (root / "pyproject.toml").is_file():
        return root
    return None


def validate(manifest: Mapping[str, Mapping[str, Any]] | None = None,
             op_classes: Mapping[str, type] | None = None,
             repo_root: pathlib.Path | None = None, *,
             code_level: bool = True) -> ValidationResult:
    """Checks every manifest entry against the schema, the code and itself.

    Args:
        manifest: {op name: entry}; defaults to the shipped manifest.
        op_classes: {op name: Op class}; defaults to `tileops.ops.OP_CLASSES`.
        repo_root: where `source` paths are resolved; defaults to the checkout this package
            runs from. When the package is not running from a checkout, the source-path
            check is skipped and a note says so.
        code_level: False stops after the manifest level (no torch, no TileLang, no Op
            classes: `op_classes` is not read).

    Returns:
        The errors (a list of `ManifestError`, empty when all is well), with `.notes`.
    """
    run = Validation(manifest, repo_root)
    result = run.manifest_level()
    if code_level:
        result.extend(run.code_level(op_classes))
    return result


class Validation:
    """One validation in its two stages: `manifest_level()`, then `code_level()`."""

    def __init__(self, manifest: Mapping[str, Mapping[str, Any]] | None = None,
                 repo_root: pathlib.Path | None = None):
        self.manifest = load_manifest() if manifest is None else manifest
        self.notes: list[str] = []
        if repo_root is None:
            repo_root = default_repo_root()
            if repo_root is None:
                self.notes.append(
                    f"source paths not checked: tileops runs from {_PACKAGE_DIR}, not from a "
                    "source checkout (install with `pip install -e .` to check them)")
        self._entries = [_EntryValidator(name, entry, repo_root)
                         for name, entry in self.manifest.items()]
        self._manifest_checked = False

    def manifest_level(self) -> ValidationResult:
        """L0, the shape rules on the manifest's own workloads, L4, labels, source paths;
        imports neither torch nor TileLang. Its result carries the notes."""
        self._manifest_checked = True
        return ValidationResult([e for v in self._entries for e in v.run_manifest_level()],
                                self.notes)

    def code_level(self, op_classes: Mapping[str, type] | None = None) -> ValidationResult:
        """L1, the Op's own `check` on the workloads, L3; loads the op layer (torch and
        TileLang) unless given `op_classes`. Runs after `manifest_level`, whose compiled
        specs and accepted workloads it uses."""
        if not self._manifest_checked:
            raise RuntimeError("Validation.code_level() runs after manifest_level()")
        if op_classes is None:
            from .ops import OP_CLASSES

            op_classes = OP_CLASSES
        errors = [e for v in self._entries for e in v.run_code_level(op_classes.get(v.name))]
        for name in op_classes:
            if name not in self.manifest:
                errors.append(ManifestError(
                    f"{name}: field '<entry>': expected a manifest entry for this Op class, "
                    "found none"))
        return ValidationResult(errors)


class _EntryValidator:
    """All checks of one manifest entry, in the two stages; each returns its errors."""

    def __init__(self, name: str, entry: Any, repo_root: pathlib.Path | None):
        self.name = name
        self.entry = entry
        self.repo_root = repo_root
        self.cls: Any = None
        self.errors: list[ManifestError] = []
        self.spec: CompiledSpec | None = None
        # (index, workload) of the workloads the manifest level accepted
        self.good: list[tuple[int, dict[str, Any]]] = []

    def error(self, field: str, message: str) -> None:
        self.errors.append(ManifestError(f"{self.name}: field '{field}': {message}"))

    def run_manifest_level(self) -> list[ManifestError]:
        self.errors = []
        self.spec = self.check_schema()
        if self.spec is None:
            return self.errors  # nothing further can be read reliably from a broken entry
        implemented = self.entry["status"] == "implemented"
        self.check_workload_list(implemented)
        self.good = self.check_workloads(self.spec)
        if implemented:
            self.check_source_paths()
        return self.errors

    def run_code_level(self, cls: type | None) -> list[ManifestError]:
        self.errors = []
        if self.spec is None or self.entry["status"] != "implemented":
            return self.errors  # a broken entry, or one with no code to compare
        self.cls = cls
        self.check_class()
        if self.errors or not callable(getattr(cls, "check", None)):
            return self.errors  # a stand-in class, or one L1 already found wrong
        accepted = [w for i, w in self.good if self.check_op_accepts(self.spec, w,
                                                                     f"workloads[{i}]")]
        if accepted:
            self.check_dtypes_accepted(self.spec, accepted[0])
        return self.errors

    # -- L0 -------------------------------------------------------------------------------
    def check_schema(self) -> CompiledSpec | None:
        errors = schema_errors(self.name, self.entry)
        if errors:
            self.errors.extend(errors)
            return None
        try:
            return CompiledSpec(self.name, self.entry)
        except ManifestError as e:
            self.errors.append(e)
        except Exception as e:  # noqa: BLE001 - e.g. a roofline.func that does not import
            self.error("<entry>", f"does not compile into a spec: {type(e).__name__}: {e}")
        return None

    # -- L1 -------------------------------------------------------------------------------
    def check_class(self) -> None:
        cls = self.cls
        if cls is None:
            self.error("status", f"expected an Op class named '{self.name}' (the entry is "
                                 "'implemented'), found none")
            return
        if getattr(cls, "__name__", None) != self.name:
            self.error("<entry>", f"expected the Op class to be named '{self.name}', "
                                  f"found '{getattr(cls, '__name__', cls)}'")
        self.check_init(cls)
        self.check_forward(cls)
        self.check_kernel_map(cls)

    def check_init(self, cls: type) -> None:
        sig = inspect.signature(cls.__init__)
        params = list(sig.parameters.values())[1:]  # after self
        positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY,
                                                           p.POSITIONAL_OR_KEYWORD,
                                                           p.VAR_POSITIONAL)]
        if positional:
            self.error("signature.params", f"expected {cls.__name__}.__init__ to take keyword-"
                                           f"only params, found positional {positional}")
        kw = {p.name: p for p in params
              if p.kind is p.KEYWORD_ONLY and p.name not in _OP_OWN_PARAMS}
        declared = self.entry["signature"].get("params") or {}
        if list(kw) != list(declared):
            self.error("signature.params",
                       f"expected {cls.__name__}.__init__ keyword-only params {list(declared)} "
                       f"(manifest order), found {list(kw)}")
            return
        for pname, pdecl in declared.items():
            code_default = kw[pname].default
            if "default" not in pdecl:
                if code_default is not inspect.Parameter.empty:
                    self.error(f"signature.params.{pname}.default",
                               f"expected {cls.__name__}.__init__ param '{pname}' to be "
                               f"required (no default in the manifest), found default "
                               f"{code_default!r}")
            elif code_default is inspect.Parameter.empty:
                self.error(f"signature.params.{pname}.default",
                           f"expected {cls.__name__}.__init__ param '{pname}' to default to "
                           f"{pdecl['default']!r}, found no default")
            elif not _same_value(code_default, pdecl["default"]):
                self.error(f"signature.params.{pname}.default",
                           f"expected {cls.__name__}.__init__ param '{pname}' to default to "
                           f"{pdecl['default']!r}, found {code_default!r}")

    def check_forward(self, cls: type) -> None:
        forward = getattr(cls, "forward", None)
        if not callable(forward):
            self.error("signature.inputs", f"expected {cls.__name__}.forward, found none")
            return
        params = list(inspect.signature(forward).parameters.values())[1:]  # after self
        if any(p.kind is p.VAR_POSITIONAL for p in params):
            self.error("signature.inputs",
                       f"expected {cls.__name__}.forward to name its inputs, found *args")
            return
        found = {p.name: p for p in params
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)}
        declared = self.entry["signature"]["inputs"]
        if list(found) != list(declared):
            self.error("signature.inputs",
                       f"expected {cls.__name__}.forward positional params {list(declared)} "
                       f"(manifest order), found {list(found)}")
            return
        for iname, idecl in declared.items():
            has_default = found[iname].default is not inspect.Parameter.empty
            if idecl.get("optional", False) and found[iname].default is not None:
                got = repr(found[iname].default) if has_default else "no default"
                self.error(f"signature.inputs.{iname}.optional",
                           f"expected {cls.__name__}.forward param '{iname}' to default to "
                           f"None (the input is optional), found {got}")
            elif not idecl.get("optional", False) and has_default:
                self.error(f"signature.inputs.{iname}.optional",
                           f"expected {cls.__name__}.forward param '{iname}' to be required "
                           f"(the input is not optional), found default "
                           f"{found[iname].default!r}")

    def check_kernel_map(self, cls: type) -> None:
        declared: dict[str, str] = self.entry["source"]["kernel_map"]
        found = getattr(cls, "kernel_map", None)
        if not isinstance(found, Mapping):
            self.error("source.kernel_map", f"expected {cls.__name__}.kernel_map to be a "
                                            f"mapping, found {type(found).__name__}")
            return
        if set(found) != set(declared):
            self.error("source.kernel_map",
                       f"expected dispatch keys {sorted(declared)}, found {sorted(found)} in "
                       f"{cls.__name__}.kernel_map")
            return
        for key, kernel_name in declared.items():
            got = getattr(found[key], "__name__", repr(found[key]))
            if got != kernel_name:
                self.error(f"source.kernel_map.{key}",
                           f"expected Kernel class '{kernel_name}', found '{got}'")

    # -- workloads: list-level checks -----------------------------------------------------
    def check_workload_list(self, implemented: bool) -> None:
        workloads = self.entry["workloads"]
        if implemented and len(workloads) < 2:
            self.error("workloads", f"expected >= 2 workloads for an implemented op, "
                                    f"found {len(workloads)}")
        seen: dict[str, int] = {}
        for i, w in enumerate(workloads):
            if w["label"] in seen:
                self.error(f"workloads[{i}].label",
                           f"expected a unique label, found {w['label']!r} again "
                           f"(first at workloads[{seen[w['label']]}])")
            seen.setdefault(w["label"], i)

    # -- L2 and L4 ------------------------------------------------------------------------
    def check_workloads(self, spec: CompiledSpec) -> list[tuple[int, dict[str, Any]]]:
        """Checks every workload on the manifest; returns (index, workload) of those that
        passed L2, in order."""
        good = []
        for i, w in enumerate(self.entry["workloads"]):
            where = f"workloads[{i}]"
            errors_before = len(self.errors)
            self.check_workload_names(spec, w, where)
            if len(self.errors) > errors_before:
                continue
            namespaces = self.check_shape_rules(spec, w, where)
            if namespaces is None:
                continue
            rooflines: dict[tuple, Any] = {}
            for dtype, ns in namespaces.items():
                self.check_roofline(spec, ns, f"{where} ({w['label']!r}, {dtype})", rooflines)
            good.append((i, w))
        return good

    def check_workload_names(self, spec: CompiledSpec, w: Mapping[str, Any], where: str) -> None:
        label = w["label"]
        for iname in w["inputs"]:
            if iname not in spec.input_names:
                self.error(f"{where}.inputs.{iname}",
                           f"({label!r}) expected an input of {spec.input_names}, "
                           f"found '{iname}'")
        for t in spec.inputs:
            if not t.optional and w["inputs"].get(t.name) is None:
                self.error(f"{where}.inputs.{t.name}",
                           f"({label!r}) expected a shape (the input is not optional), "
                           "found none")
        params = w.get("params") or {}
        for pname in params:
            if pname not in spec.param_names:
                self.error(f"{where}.params.{pname}",
                           f"({label!r}) expected a param of {spec.param_names}, "
                           f"found '{pname}'")
        for p in spec.params:
            if p.required and p.name not in params:
                self.error(f"{where}.params.{p.name}",
                           f"({label!r}) expected a value (the param has no default), "
                           "found none")
            elif p.name in params:
                try:
                    p.check(self.name, params[p.name])
                except TileOpsError as e:
                    self.error(f"{where}.params.{p.name}", f"({label!r}) {_strip(self.name, e)}")
        for dtype in w["dtypes"]:
            if not any(dtype in t.dtype.names for t in spec.inputs):
                self.error(f"{where}.dtypes",
                           f"({label!r}) expected declared dtypes ({_declared_dtypes(spec)}), "
                           f"found {dtype}")

    def check_shape_rules(self, spec: CompiledSpec, w: Mapping[str, Any],
                          where: str) -> dict[str, dict[str, Any]] | None:
        """The expression namespace per workload dtype, or None after reporting a failure."""
        params = spec.workload_params(w)
        namespaces = {}
        for dtype in w["dtypes"]:
            try:
                tensors = spec.workload_tensors(w, dtype, stand_ins=True)
                spec.check_dtypes(tensors)
                ns = spec.namespace(tensors, params)
                spec.check_shapes(ns)
            except TileOpsError as e:
                self.error(where, f"({w['label']!r}, {dtype}) violates the signature: "
                                  f"{_strip(self.name, e)}")
                return None
            except Exception as e:  # noqa: BLE001 - a spec that cannot check a workload
                self.error(where, f"({w['label']!r}, {dtype}) expected the signature checks "
                                  f"to run, found {type(e).__name__}: {e}")
                return None
            namespaces[dtype] = ns
        return namespaces

    def check_op_accepts(self, spec: CompiledSpec, w: Mapping[str, Any], where: str) -> bool:
        """The Op's own `check` must accept a workload the manifest accepts."""
        try:
            op = self.cls(**spec.workload_params(w))
        except Exception as e:  # noqa: BLE001 - any failure is a disagreement to report
            self.error(where, f"({w['label']!r}) expected {self.name} to construct with the "
                              f"workload params, found {type(e).__name__}: {_strip(self.name, e)}")
            return False
        for dtype in w["dtypes"]:
            tensors = spec.workload_tensors(w, dtype)
            try:
                op.check([tensors[n] for n in spec.input_names])
            except Exception as e:  # noqa: BLE001 - any failure is a disagreement to report
                self.error(where, f"({w['label']!r}, {dtype}) expected the Op to accept the "
                                  f"workload, found {type(e).__name__}: {_strip(self.name, e)}")
                return False
        return True

    def check_roofline(self, spec: CompiledSpec, ns: Mapping[str, Any], where: str,
                       seen: dict[tuple, Any]) -> None:
        field = "roofline.func" if "func" in self.entry["roofline"] else "roofline"
        values = _roofline_of(spec, ns, seen)
        if isinstance(values, Exception):  # inf/nan and expression errors land here
            self.error(_failing_roofline_field(spec, ns) or field,
                       f"on {where}: expected finite non-negative integers, found "
                       f"{type(values).__name__}: {values}")
            return
        for what, value in zip(("flops", "bytes"), values, strict=True):
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
            if not ok or not math.isfinite(value):
                sub = field if field.endswith("func") else f"roofline.{what}"
                self.error(sub, f"on {where}: expected a finite non-negative integer, "
                                f"found {value!r}")

    # -- L3 -------------------------------------------------------------------------------
    def check_dtypes_accepted(self, spec: CompiledSpec, w: Mapping[str, Any]) -> None:
        """Probes the Op's `check` with every probe dtype on the first good workload."""
        import torch

        from .manifest.spec import DTYPES

        field = _dtype_field(spec)
        op = self.cls(**spec.workload_params(w))  # constructed fine in L2 already
        for dtype_name in L3_PROBE_DTYPES:
            dtype = DTYPES[dtype_name]
            # Every input gets the probe dtype, so same_as inputs follow their reference.
            tensors = {t.name: None if w["inputs"].get(t.name) is None
                       else torch.empty(w["inputs"][t.name], dtype=dtype, device="meta")
                       for t in spec.inputs}
            try:
                spec.check_dtypes(tensors)
                declared = True
            except TileOpsTypeError:
                declared = False
            except Exception as e:  # noqa: BLE001 - a spec that cannot check this dtype
                self.error(field, f"expected the dtype checks to run on {dtype_name}, found "
                                  f"{type(e).__name__}: {e}")
                continue
            try:
                op.check([tensors[n] for n in spec.input_names])
                outcome: BaseException | None = None
            except Exception as e:  # noqa: BLE001 - the kind of exception is what is checked
                outcome = e
            if declared and outcome is not None:
                self.error(field, f"expected the Op to accept declared dtype {dtype_name} "
                                  f"({w['label']!r} shapes), found {type(outcome).__name__}: "
                                  f"{_strip(self.name, outcome)}")
            elif not declared and outcome is None:
                self.error(field, f"expected the Op to reject {dtype_name} (declared: "
                                  f"{_declared_dtypes(spec)}), found it accepted")
            elif not declared and not isinstance(outcome, TileOpsTypeError):
                self.error(field, f"expected TileOpsTypeError for undeclared dtype "
                                  f"{dtype_name}, found {type(outcome).__name__}: "
                                  f"{_strip(self.name, outcome)}")

    # -- source paths ---------------------------------------------------------------------
    def check_source_paths(self) -> None:
        if self.repo_root is None:
            return
        source = self.entry["source"]
        paths = [("source.op", source["op"])]
        paths += [(f"source.kernels[{i}]", p) for i, p in enumerate(source["kernels"])]
        paths += [("source.test", source["test"]), ("source.bench", source["bench"])]
        for field, rel in paths:
            if not (self.repo_root / rel).is_file():
                self.error(field, f"expected an existing file {rel} (relative to "
                                  f"{self.repo_root}), found none")


def _roofline_of(spec: CompiledSpec, ns: Mapping[str, Any], seen: dict[tuple, Any]) -> Any:
    """The roofline's (flops, bytes) on one dtype's namespace of a workload, or what it raised.

    The namespaces of one workload's dtypes differ only in the stand-ins' dtypes and in dims
    computed from them. So when the roofline read no dtype, its result holds for every
    dtype of the same element sizes and dims; the attention formulas, which loop over the
    sequence, are evaluated once instead of once per dtype.
    """
    tensors = [ns[t.name] for t in spec.inputs if ns.get(t.name) is not None]
    key = (tuple(t.element_size() for t in tensors), repr([ns[d] for d in spec.dims]))
    if key in seen:
        return seen[key]
    reads = ShapeTensor.dtype_reads
    try:
        values: Any = spec.roofline_values(ns)
    except Exception as e:  # noqa: BLE001 - the caller reports it
        values = e
    if ShapeTensor.dtype_reads == reads and all(isinstance(t, ShapeTensor) for t in tensors):
        seen[key] = values
    return values


def _failing_roofline_field(spec: CompiledSpec, ns: Mapping[str, Any]) -> str | None:
    """Which of flops/bytes raises or is not finite, to name it in the error (None: unknown)."""
    if spec.roofline is None:
        return None
    ns = {**ns, "elem_bytes": 1}  # any size will do to find the failing expression
    for expr in spec.roofline:
        try:
            value = expr(ns)
            if isinstance(value, float) and not math.isfinite(value):
                return expr.where
        except Exception:  # noqa: BLE001 - this is the one
            return expr.where
    return None


def _same_value(a: Any, b: Any) -> bool:
    """Equality that treats lists and tuples alike (YAML has only lists)."""
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b  # False == 0 to Python, never to a manifest default
    return a == b


def _strip(op_name: str, error: BaseException) -> str:
    """An error message without its leading '<op>: ' (the caller already names the op)."""
    return str(error).removeprefix(f"{op_name}: ")


def _declared_dtypes(spec: CompiledSpec) -> str:
    names = dict.fromkeys(d for t in spec.inputs for d in t.dtype.names)
    return " | ".join(names) or "none"


def _dtype_field(spec: CompiledSpec) -> str:
    """The manifest field that declares the dtypes: the first input not `same_as` another."""
    first = next((t.name for t in spec.inputs if not t.dtype.same_as), spec.input_names[0])
    return f"signature.inputs.{first}.dtype"


__all__ = ["validate", "Validation", "ValidationResult", "default_repo_root",
           "L3_PROBE_DTYPES"]
