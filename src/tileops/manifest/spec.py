"""A manifest entry compiled into the checks and derivations every Op shares.

The expressions of an entry (dims, shape rules, output shapes, roofline) are compiled once
and evaluated per call over a namespace of the call's tensors, params and dims.

This module does not import torch: the manifest-level checks of `tileops validate` run on
`ShapeTensor` stand-ins in a fraction of a second. Dtypes are compared by name, so the same
checks take torch tensors (from the op layer, which has torch loaded) or stand-ins.
`DTYPES` and `DTYPE_NAMES`, the tables between names and torch's dtypes, import torch on
their first lookup.
"""

from __future__ import annotations

import ast
import functools
import importlib
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import ManifestError, TileOpsTypeError, TileOpsValueError, op_error

# The dtypes a manifest may name, with their element sizes in bytes.
DTYPE_SIZES: dict[str, int] = {
    "float16": 2, "bfloat16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int32": 4, "int64": 8,
}


@functools.cache
def _torch_dtypes() -> dict[str, Any]:
    import torch

    return {name: getattr(torch, name) for name in DTYPE_SIZES}


def __getattr__(name: str) -> Any:
    """`DTYPES` (name -> torch.dtype) and `DTYPE_NAMES` (torch.dtype -> name), built, and
    torch imported, on first lookup (`from ..manifest.spec import DTYPE_NAMES` included)."""
    if name == "DTYPES":
        value: Any = dict(_torch_dtypes())
    elif name == "DTYPE_NAMES":
        value = {v: k for k, v in _torch_dtypes().items()}
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # later lookups skip this function
    return value


def dtype_name(dtype: Any) -> str:
    """'bfloat16' for torch.bfloat16 or a stand-in's dtype (both print as 'torch.bfloat16')."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class ShapeDtype:
    """A dtype by name, printing as torch's does, so error messages read the same."""

    name: str

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.name]

    @property
    def is_floating_point(self) -> bool:
        return not self.name.startswith("int")

    def __repr__(self) -> str:
        return f"torch.{self.name}"

    __str__ = __repr__


@dataclass(frozen=True)
class _Device:
    type: str

    def __str__(self) -> str:
        return self.type


class ShapeTensor:
    """A light stand-in for a meta tensor (or, with `values`, a small CPU tensor): what the
    manifest's expressions and roofline functions read of a workload's tensors, no torch."""

    # Reads of any stand-in's dtype, counted: a roofline that reads none gives the same
    # values for every dtype of one element size, so the validator evaluates it once.
    dtype_reads = 0

    def __init__(self, shape: Sequence[int], dtype: str, values: list[int] | None = None):
        self.shape = tuple(int(s) for s in shape)
        self._dtype = ShapeDtype(dtype)
        self.device = _Device("meta" if values is None else "cpu")
        self._values = values

    @property
    def dtype(self) -> ShapeDtype:
        ShapeTensor.dtype_reads += 1
        return self._dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def dim(self) -> int:
        return len(self.shape)

    def size(self, dim: int | None = None) -> Any:
        return self.shape if dim is None else self.shape[dim]

    def numel(self) -> int:
        return math.prod(self.shape)

    def element_size(self) -> int:
        return DTYPE_SIZES[self._dtype.name]

    def tolist(self) -> list[int]:
        if self._values is None:
            raise ValueError("a ShapeTensor without values (a meta tensor's stand-in) has no "
                         "data")
        return list(self._values)

    def __repr__(self) -> str:
        return f"ShapeTensor(shape={self.shape}, dtype={self._dtype})"


def _is_tensor(value: Any) -> bool:
    if isinstance(value, ShapeTensor):
        return True
    torch = sys.modules.get("torch")  # not loaded: then `value` is no torch tensor either
    return torch is not None and isinstance(value, torch.Tensor)


def numel(t: Any) -> int:
    return math.prod(t.shape)


# Names an expression may use besides the call's tensors, params and dims.
HELPERS: dict[str, Any] = {
    "prod": math.prod, "numel": numel, "len": len, "tuple": tuple, "list": list,
    "min": min, "max": max, "all": all, "any": any, "abs": abs, "int": int,
    "ceil_div": lambda a, b: -(-a // b),
}


@dataclass(frozen=True)
class Expr:
    """One compiled manifest expression, remembering its text and the names it reads."""

    text: str
    where: str
    code: Any = field(repr=False)
    names: tuple[str, ...]

    @classmethod
    def compile(cls, op: str, where: str, text: str) -> Expr:
        try:
            tree = ast.parse(text, mode="eval")
        except SyntaxError as e:
            raise ManifestError(
                f"{op}: field '{where}': not a Python expression: {text!r} ({e})") from None
        # names bound inside the expression (comprehension variables) are not inputs
        bound = {n.id for c in ast.walk(tree) if isinstance(c, ast.comprehension)
                 for n in ast.walk(c.target) if isinstance(n, ast.Name)}
        names = tuple(dict.fromkeys(n.id for n in ast.walk(tree)
                                    if isinstance(n, ast.Name) and n.id not in bound))
        return cls(text, where, compile(tree, f"<{op}.{where}>", "eval"), names)

    def __call__(self, namespace: Mapping[str, Any]) -> Any:
        return eval(self.code, {"__builtins__": {}}, namespace)  # noqa: S307 - manifest text


@dataclass(frozen=True)
class DtypeRule:
    names: tuple[str, ...] = ()  # the dtypes allowed, by name ('bfloat16')
    same_as: str | None = None

    @property
    def allowed(self) -> tuple[Any, ...]:
        """The allowed torch dtypes (imports torch)."""
        return tuple(_torch_dtypes()[n] for n in self.names)

    @classmethod
    def parse(cls, op: str, where: str, text: str) -> DtypeRule:
        text = text.strip()
        if text.startswith("same_as(") and text.endswith(")"):
            return cls(same_as=text[len("same_as("):-1].strip())
        names = [t.strip() for t in text.split("|")]
        unknown = [n for n in names if n not in DTYPE_SIZES]
        if unknown:
            raise ManifestError(f"{op}: field '{where}': unknown dtype(s) {unknown}; "
                                f"known: {sorted(DTYPE_SIZES)}")
        return cls(names=tuple(names))

    def describe(self) -> str:
        if self.same_as:
            return f"same_as({self.same_as})"
        return " | ".join(self.names)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: DtypeRule
    optional: bool = False
    shape: Expr | None = None
    layout: str | None = None


_PARAM_TYPES: dict[str, tuple[type, ...]] = {
    "bool": (bool,), "int": (int,), "float": (float, int), "str": (str,),
    "list[int]": (list, tuple), "None": (type(None),),
}


@dataclass(frozen=True)
class ParamSpec:
    name: str
    type: str
    default: Any
    required: bool

    def check(self, op: str, value: Any) -> None:
        accepted: tuple[type, ...] = ()
        for part in self.type.split("|"):
            accepted += _PARAM_TYPES.get(part.strip(), (object,))
        ok = isinstance(value, accepted)
        if ok and bool not in accepted and isinstance(value, bool):
            ok = False  # a bool is an int to Python, never to a manifest param
        if ok and self.type == "list[int]":
            ok = all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        if not ok:
            raise op_error(TileOpsTypeError, op, self.name, self.type, repr(value))


def _parse_shape(op: str, where: str, text: str) -> list[str | int]:
    try:
        tree = ast.parse(text, mode="eval").body
        if not isinstance(tree, ast.List | ast.Tuple):
            raise ValueError
        dims: list[str | int] = []
        for elt in tree.elts:
            if isinstance(elt, ast.Name):
                dims.append(elt.id)
            elif isinstance(elt, ast.Constant) and isinstance(elt.value, int):
                dims.append(elt.value)
            else:
                raise ValueError
    except (SyntaxError, ValueError):
        raise ManifestError(f"{op}: field '{where}': expected a list of names or integers "
                            f"such as \"[M, K]\", got {text!r}") from None
    return dims


class CompiledSpec:
    """Checks and derivations for one op, built once from its manifest entry."""

    def __init__(self, op_name: str, entry: Mapping[str, Any]):
        self.op_name = op_name
        self.entry = entry
        sig = entry["signature"]
        self.inputs = [
            TensorSpec(n, DtypeRule.parse(op_name, f"signature.inputs.{n}.dtype", t["dtype"]),
                       bool(t.get("optional", False)), None, t.get("layout"))
            for n, t in sig["inputs"].items()
        ]
        # Fixed-rank input shapes such as "[M, K]": names bind across tensors.
        self.input_shapes: dict[str, list[str | int]] = {}
        self.shape_name_owner: dict[str, str] = {}  # shape name -> first input binding it
        for n, t in sig["inputs"].items():
            if "shape" in t:
                self.input_shapes[n] = _parse_shape(op_name, f"signature.inputs.{n}.shape",
                                                    t["shape"])
                for dim in self.input_shapes[n]:
                    if isinstance(dim, str):
                        self.shape_name_owner.setdefault(dim, n)
        self.outputs = [
            TensorSpec(n, DtypeRule.parse(op_name, f"signature.outputs.{n}.dtype", t["dtype"]),
                       False, Expr.compile(op_name, f"signature.outputs.{n}.shape",
                                           t.get("shape", "()")))
            for n, t in sig["outputs"].items()
        ]
        self.params = [
            ParamSpec(n, p["type"], p.get("default"), "default" not in p)
            for n, p in (sig.get("params") or {}).items()
        ]
        self.dims = {n: Expr.compile(op_name, f"signature.dims.{n}", e)
                     for n, e in (sig.get("dims") or {}).items()}
        self.shape_rules = [Expr.compile(op_name, f"signature.shape_rules[{i}]", r)
                            for i, r in enumerate(sig.get("shape_rules") or [])]
        self._check_rule_names()
        self.call_order = self._call_order(sig.get("call_order"))
        # rule -> (the input it blames, or None; whether it reads a tensor at all)
        self._blame = {rule.where: self._rule_subject(rule) for rule in self.shape_rules}
        self.dtype_combos: list[dict[str, str]] = [  # input name -> dtype name
            dict(combo) for combo in sig.get("dtype_combos") or []]
        roof = entry["roofline"]
        if "func" in roof:
            module, _, fn = roof["func"].rpartition(".")
            self._roofline_func = getattr(importlib.import_module(module), fn)
            self.roofline = None
        else:
            self._roofline_func = None
            self.roofline = (Expr.compile(op_name, "roofline.flops", roof["flops"]),
                             Expr.compile(op_name, "roofline.bytes", roof["bytes"]))
        for spec in self.inputs + self.outputs:
            ref = spec.dtype.same_as
            if ref and ref not in self.input_names:
                raise ManifestError(f"{op_name}: field 'signature.*.{spec.name}.dtype': "
                                    f"same_as({ref}) names no input")

    @property
    def input_names(self) -> list[str]:
        return [t.name for t in self.inputs]

    @property
    def param_names(self) -> list[str]:
        return [p.name for p in self.params]

    def _check_rule_names(self) -> None:
        """A rule or dim naming something the call does not have is a manifest error, found
        here once rather than reported per call as a failing rule."""
        known = (set(HELPERS) | set(self.input_names) | set(self.param_names) | set(self.dims)
                 | set(self.shape_name_owner) | {"None", "True", "False"})
        for expr in [*self.dims.values(), *self.shape_rules]:
            unknown = [n for n in expr.names if n not in known]
            if unknown:
                raise ManifestError(f"{self.op_name}: field '{expr.where}': {expr.text!r} names "
                                    f"{unknown}, which are no input, param, dim or shape name")

    def _call_order(self, order: list[str] | None) -> list[str]:
        """The argument order of the functional API and the torch.ops schema: the manifest's
        `call_order` (the reference API's order), else the inputs, then the params."""
        names = self.input_names + self.param_names
        if order is None:
            return names
        if sorted(order) != sorted(names):
            raise ManifestError(f"{self.op_name}: field 'signature.call_order': expected every "
                                f"input and param once ({names} in some order), got {order}")
        return list(order)

    def _rule_subject(self, rule: Expr) -> tuple[str | None, bool]:
        """The input a failing rule blames, and whether the rule reads any tensor.

        A rule that relates several inputs blames the last of them in signature order: the
        earlier ones set the sizes (q's head count), the later one fails to match (k's). An
        input counts when the rule reads it, a shape name it binds first, or a dim computed
        from it.
        """
        read: set[str] = set()
        pending, seen = list(rule.names), set()
        while pending:
            name = pending.pop()
            if name in seen:
                continue
            seen.add(name)
            if name in self.input_names:
                read.add(name)
            elif name in self.shape_name_owner:
                read.add(self.shape_name_owner[name])
            elif name in self.dims:
                pending.extend(self.dims[name].names)
        last = max(read, key=self.input_names.index, default=None)
        return last, bool(read)

    # -- checks ---------------------------------------------------------------------------
    def check_dtypes(self, tensors: Mapping[str, Any]) -> None:
        for spec in self.inputs:
            t = tensors.get(spec.name)
            if t is None:
                continue
            if spec.dtype.same_as:
                ref = tensors.get(spec.dtype.same_as)
                if ref is None:
                    raise op_error(TileOpsValueError, self.op_name, spec.dtype.same_as,
                                   f"a tensor (input '{spec.name}' takes its dtype)", "None")
                want = ref.dtype
                if dtype_name(t.dtype) != dtype_name(want):
                    raise op_error(TileOpsTypeError, self.op_name, spec.name,
                                   f"dtype {want} (same as '{spec.dtype.same_as}')", t.dtype)
            elif dtype_name(t.dtype) not in spec.dtype.names:
                raise op_error(TileOpsTypeError, self.op_name, spec.name,
                               f"dtype {spec.dtype.describe()}", t.dtype)
        if self.dtype_combos:
            got = {n: t.dtype for n, t in tensors.items() if t is not None}
            names = {n: dtype_name(d) for n, d in got.items()}
            if not any(all(names.get(n) == d for n, d in c.items()) for c in self.dtype_combos):
                raise op_error(TileOpsTypeError, self.op_name, "dtypes",
                               f"one of {self.entry['signature']['dtype_combos']}", got)

    def bind_shapes(self, tensors: Mapping[str, Any]) -> dict[str, int]:
        """Checks fixed-rank input shapes and returns the sizes their names bind."""
        bound: dict[str, tuple[int, str]] = {}
        for name, dims in self.input_shapes.items():
            t = tensors.get(name)
            if t is None:
                continue
            expected = "[" + ", ".join(map(str, dims)) + "]"
            if t.ndim != len(dims):
                raise op_error(TileOpsValueError, self.op_name, name,
                               f"shape {expected} ({len(dims)} dims)", f"shape {tuple(t.shape)}")
            for dim, size in zip(dims, t.shape, strict=True):
                if isinstance(dim, int):
                    ok, want = size == dim, f"{dim}"
                elif dim in bound:
                    ok, want = size == bound[dim][0], f"{bound[dim][0]} (from {bound[dim][1]})"
                else:
                    bound[dim] = (int(size), name)
                    continue
                if not ok:
                    raise op_error(TileOpsValueError, self.op_name, name,
                                   f"shape {expected} with {dim} = {want}",
                                   f"shape {tuple(t.shape)}")
        return {k: v[0] for k, v in bound.items()}

    def namespace(self, tensors: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
        """Tensors, params, bound shape names and the derived dims, as expressions see them."""
        ns: dict[str, Any] = dict(HELPERS)
        ns.update(params)
        ns.update(tensors)
        ns.update(self.bind_shapes(tensors))
        for name, expr in self.dims.items():
            try:
                ns[name] = expr(ns)
            except Exception:  # a broken input shape; the shape rules report it
                ns[name] = None
        return ns

    def check_shapes(self, ns: Mapping[str, Any]) -> None:
        for rule in self.shape_rules:
            try:
                ok = bool(rule(ns))
            except Exception:  # noqa: BLE001 - a rule that cannot be evaluated does not hold
                ok = False
            if not ok:
                raise self._rule_error(rule, ns)

    def _rule_error(self, rule: Expr, ns: Mapping[str, Any]) -> TileOpsValueError:
        """'argument <blamed>: expected shapes (or a value) satisfying `<rule>`, got <values>'.

        The blamed argument is an input (see `_rule_subject`), else the first param the rule
        reads. The values are those of every name the rule reads, plus the blamed tensor's
        shape; never the text of an exception the rule raised on them.
        """
        arg, reads_tensor = self._blame[rule.where]
        arg = arg or next((n for n in rule.names if n in self.param_names), "inputs")
        shown = [n for n in rule.names if n != arg and (
            n in self.input_names or n in self.param_names or n in self.dims
            or n in self.shape_name_owner)]
        if arg in self.input_names or arg in rule.names:
            shown.insert(0, arg)
        seen = ", ".join(self._describe(n, ns) for n in shown)
        what = "shapes" if reads_tensor else "a value"
        return op_error(TileOpsValueError, self.op_name, arg,
                        f"{what} satisfying `{rule.text}`", seen)

    @staticmethod
    def _describe(name: str, ns: Mapping[str, Any]) -> str:
        v = ns.get(name)
        if _is_tensor(v):
            return f"{name}.shape={tuple(v.shape)}"
        return f"{name}={v!r}"

    # -- derivations ----------------------------------------------------------------------
    def output_meta(self, ns: Mapping[str, Any]) -> list[tuple[tuple[int, ...], Any]]:
        """(shape, torch dtype) of each output; imports torch."""
        metas = []
        for spec in self.outputs:
            shape = tuple(int(s) for s in spec.shape(ns))
            dtype = (ns[spec.dtype.same_as].dtype if spec.dtype.same_as
                     else _torch_dtypes()[spec.dtype.names[0]])
            metas.append((shape, dtype))
        return metas

    def roofline_values(self, ns: Mapping[str, Any]) -> tuple[Any, Any]:
        """(flops, bytes) as the manifest's expressions or function compute them, unchecked."""
        first = next(ns[t.name] for t in self.inputs if ns.get(t.name) is not None)
        ns = {**ns, "elem_bytes": first.element_size()}
        if self._roofline_func is not None:
            return self._roofline_func(**ns)
        return self.roofline[0](ns), self.roofline[1](ns)

    def eval_roofline(self, ns: Mapping[str, Any]) -> tuple[int, int]:
        flops, nbytes = self.roofline_values(ns)
        for what, value in (("flops", flops), ("bytes", nbytes)):
            if not (math.isfinite(value) and value >= 0 and float(value).is_integer()):
                raise ManifestError(f"{self.op_name}: field 'roofline.{what}': expected a "
                                    f"finite non-negative integer, got {value!r}")
        return int(flops), int(nbytes)

    def workload_tensors(self, workload: Mapping[str, Any], dtype: str,
                         stand_ins: bool = False) -> dict[str, Any]:
        """A workload's tensors (inputs in `dtype` unless an input's dtype rule says else).

        Meta tensors, and real CPU tensors for the inputs whose values the workload gives
        (`data`, e.g. cu_seqlens); with `stand_ins`, `ShapeTensor`s in their place (no torch).
        """
        tensors: dict[str, Any] = {}
        for spec in self.inputs:
            shape = workload["inputs"].get(spec.name)
            name = dtype
            allowed = spec.dtype.names
            if allowed and name not in allowed:
                if len(allowed) > 1:  # the workload names a dtype this input cannot take
                    raise ManifestError(
                        f"{self.op_name}: workload '{workload['label']}': dtype {dtype} is not "
                        f"one of input '{spec.name}' dtypes {spec.dtype.describe()}")
                name = allowed[0]  # a fixed-dtype input (an index, a scale)
            values = (workload.get("data") or {}).get(spec.name)
            if values is not None and shape is not None and len(values) != math.prod(shape):
                raise ManifestError(
                    f"{self.op_name}: workload '{workload['label']}': input '{spec.name}' has "
                    f"{len(values)} values in `data`, its shape {shape} holds "
                    f"{math.prod(shape)}")
            if shape is None and values is None:
                tensors[spec.name] = None
            elif stand_ins:
                tensors[spec.name] = ShapeTensor(shape, name, values)
            else:
                import torch

                torch_dtype = _torch_dtypes()[name]
                tensors[spec.name] = (
                    torch.empty(shape, dtype=torch_dtype, device="meta") if values is None
                    else torch.tensor(values, dtype=torch_dtype).reshape(shape))
        return tensors

    def workload_params(self, workload: Mapping[str, Any]) -> dict[str, Any]:
        params = {p.name: p.default for p in self.params}
        params.update(workload.get("params") or {})
        return params
