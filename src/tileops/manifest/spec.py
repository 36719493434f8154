"""A manifest entry compiled into the checks and derivations every Op shares.

The expressions of an entry (dims, shape rules, output shapes, roofline) are compiled once
and evaluated per call over a namespace of the call's tensors, params and dims.
"""

from __future__ import annotations

import ast
import importlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import ManifestError, TileOpsTypeError, TileOpsValueError, op_error

DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int32": torch.int32,
    "int64": torch.int64,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


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
    allowed: tuple[torch.dtype, ...] = ()
    same_as: str | None = None

    @classmethod
    def parse(cls, op: str, where: str, text: str) -> DtypeRule:
        text = text.strip()
        if text.startswith("same_as(") and text.endswith(")"):
            return cls(same_as=text[len("same_as("):-1].strip())
        names = [t.strip() for t in text.split("|")]
        unknown = [n for n in names if n not in DTYPES]
        if unknown:
            raise ManifestError(f"{op}: field '{where}': unknown dtype(s) {unknown}; "
                                f"known: {sorted(DTYPES)}")
        return cls(allowed=tuple(DTYPES[n] for n in names))

    def describe(self) -> str:
        if self.same_as:
            return f"same_as({self.same_as})"
        return " | ".join(DTYPE_NAMES[d] for d in self.allowed)


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
        self.dtype_combos = [
            {n: DTYPES[d] for n, d in combo.items()} for combo in sig.get("dtype_combos") or []
        ]
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
                if t.dtype != want:
                    raise op_error(TileOpsTypeError, self.op_name, spec.name,
                                   f"dtype {want} (same as '{spec.dtype.same_as}')", t.dtype)
            elif t.dtype not in spec.dtype.allowed:
                raise op_error(TileOpsTypeError, self.op_name, spec.name,
                               f"dtype {spec.dtype.describe()}", t.dtype)
        if self.dtype_combos:
            got = {n: t.dtype for n, t in tensors.items() if t is not None}
            if not any(all(got.get(n) == d for n, d in c.items()) for c in self.dtype_combos):
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
        if isinstance(v, torch.Tensor):
            return f"{name}.shape={tuple(v.shape)}"
        return f"{name}={v!r}"

    # -- derivations ----------------------------------------------------------------------
    def output_meta(self, ns: Mapping[str, Any]) -> list[tuple[tuple[int, ...], torch.dtype]]:
        metas = []
        for spec in self.outputs:
            shape = tuple(int(s) for s in spec.shape(ns))
            dtype = ns[spec.dtype.same_as].dtype if spec.dtype.same_as else spec.dtype.allowed[0]
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

    def workload_tensors(self, workload: Mapping[str, Any], dtype: str) -> dict[str, Any]:
        """Meta tensors of a workload's shapes (inputs in `dtype` unless a combo says else).

        Inputs whose values the workload gives (`data`, e.g. cu_seqlens) are real CPU tensors.
        """
        tensors: dict[str, Any] = {}
        for spec in self.inputs:
            shape = workload["inputs"].get(spec.name)
            allowed = spec.dtype.allowed
            torch_dtype = DTYPES[dtype]
            if allowed and torch_dtype not in allowed:
                if len(allowed) > 1:  # the workload names a dtype this input cannot take
                    raise ManifestError(
                        f"{self.op_name}: workload '{workload['label']}': dtype {dtype} is not "
                        f"one of input '{spec.name}' dtypes {spec.dtype.describe()}")
                torch_dtype = allowed[0]  # a fixed-dtype input (an index, a scale)
            values = (workload.get("data") or {}).get(spec.name)
            if values is not None:
                tensors[spec.name] = torch.tensor(values, dtype=torch_dtype).reshape(shape)
            else:
                tensors[spec.name] = None if shape is None else torch.empty(
                    shape, dtype=torch_dtype, device="meta")
        return tensors

    def workload_params(self, workload: Mapping[str, Any]) -> dict[str, Any]:
        params = {p.name: p.default for p in self.params}
        params.update(workload.get("params") or {})
        return params
