"""Op base class: everything an operator derives from its manifest entry.

A concrete Op declares `__init__` with the manifest params, `forward` with the manifest
inputs, and `kernel_map`. The base supplies validation (dtypes, shape rules, devices), output
metadata, the roofline, the kernel cache and the `torch.ops.tileops.<name>` custom op whose
fake implementation lets torch.compile(fullgraph=True) trace through the op.

Argument orders: an Op object takes its params in the constructor and its tensors at call
time, in the manifest's input order (`op(input, weight)`). The functional API and the custom
op take the reference API's order, the manifest's `signature.call_order` (default: the
inputs, then the params), e.g. `tileops.rms_norm(input, normalized_shape, weight, eps)` and
`torch.ops.tileops.rms_norm_fwd(input, normalized_shape, weight, eps)`.

Meta tensors: a call whose inputs are all on the meta device is fully validated and returns
meta outputs of the manifest's shapes and dtypes, with no GPU and no kernel.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import torch

from ..errors import TileOpsTypeError, TileOpsValueError, op_error
from ..kernels.base import Kernel, gpu_slug, target_for_device
from ..manifest import get_spec
from ..manifest.spec import CompiledSpec
from ..prebuild import note_meta_call
from .signature import signature_builder, signature_of

LIBRARY = "tileops"
_SCHEMA_TYPES = {"bool": "bool", "int": "int", "float": "float", "str": "str",
                 "list[int]": "int[]", "float | None": "float?", "int | None": "int?"}
_gpu_names: dict[int, str] = {}
_NEW = object()  # a signature not validated yet
_MAX_SIGNATURES = 4096  # per cache: a stream of new shapes must not grow one without bound
_is_compiling = torch.compiler.is_compiling
_grad_enabled = torch._C.is_grad_enabled
_any_requires_grad = torch._C._any_requires_grad  # skips None and non-tensors


def custom_op_name(op_class_name: str) -> str:
    """'RMSNormFwdOp' -> 'rms_norm_fwd' (the torch.ops.tileops name)."""
    stem = op_class_name.removesuffix("Op")
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", stem).lower()


def _freeze(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


class Op:
    """Base of every operator. Subclasses are bound to the manifest entry of their name."""

    kernel_map: ClassVar[Mapping[str, type[Kernel]]] = {}
    spec: ClassVar[CompiledSpec]
    torch_op: ClassVar[Any]  # torch.ops.tileops.<name>.default
    # (backward, setup_context) of the custom op, from `register_autograd`
    _autograd_formula: ClassVar[tuple[Any, Any] | None]
    _instances: ClassVar[dict[tuple, Op]]
    _keyed: ClassVar[dict[tuple, Op]]  # apply_keyed's keys -> the same shared instances
    # (apply_keyed's key, the inputs' signature) -> the launch its shared instance settled on
    _keyed_launches: ClassVar[dict[tuple, Callable[..., Any]]]
    # the signature of all the manifest's inputs (ValueError for fewer: `_signature_of`)
    _signature: ClassVar[Callable[[Sequence[Any]], tuple]]
    _kernels: ClassVar[dict[tuple, Kernel]] = {}
    # per position of the custom op's arguments: an input's index or a param's name
    _call_slots: ClassVar[tuple[int | str, ...]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.spec = CompiledSpec(cls.__name__, get_spec(cls.__name__))
        cls._instances, cls._keyed, cls._keyed_launches = {}, {}, {}
        inputs = cls.spec.input_names
        cls._signature = staticmethod(signature_builder(len(inputs)))
        cls._call_slots = tuple(inputs.index(n) if n in inputs else n
                                for n in cls.spec.call_order)
        cls._autograd_formula = None
        cls.torch_op = _register_custom_op(cls)

    def __init__(self, *, kernel_map: Mapping[str, type[Kernel]] | None = None,
                 tune: bool = False, **params: Any):
        for p in self.spec.params:
            if p.name not in params:
                raise op_error(TileOpsTypeError, self.spec.op_name, p.name, "a value", "nothing")
            p.check(self.spec.op_name, params[p.name])
        unknown = set(params) - set(self.spec.param_names)
        if unknown:
            raise op_error(TileOpsTypeError, self.spec.op_name, sorted(unknown)[0],
                           f"one of the params {self.spec.param_names}", "an unknown param")
        self.params = {k: _freeze(params[k]) for k in self.spec.param_names}
        for name, value in self.params.items():
            setattr(self, name, value)
        if kernel_map is not None:
            self.kernel_map = dict(kernel_map)
        self.tune = tune
        # signature -> its launch (see `plan`; None: forward), for signatures validated
        self._validated: dict[tuple, Any] = {}
        self._kernel_memo: dict[tuple, Kernel] = {}
        self._call_memo: dict[tuple, Kernel] = {}  # see memo_kernel
        self._last_signature: tuple | None = None

    @classmethod
    def cached(cls, **params: Any) -> Op:
        """A shared instance per params (what the functional API and the custom op use).

        The key holds each value's type as well: 5 and 5.0 hash alike, and an instance made
        for one must not accept the other unchecked. Hashable params (the functional API
        passes tuples) take the fast path; a list is frozen into a tuple first.
        """
        key = tuple([(k, v, type(v)) for k, v in params.items()])
        try:
            op = cls._instances.get(key)
        except TypeError:  # an unhashable (list) param
            key = tuple([(k, _freeze(v), type(v)) for k, v in params.items()])
            op = cls._instances.get(key)
        if op is None:
            op = cls._instances[key] = cls(**params)
        return op

    # -- calling --------------------------------------------------------------------------
    def __call__(self, *inputs: Any) -> Any:
        """Runs the op on `inputs`, given in the manifest's input order."""
        # (is_compiling first: torch.compile folds it, and never traces the C calls after it)
        if _is_compiling() or _grad_enabled() and _any_requires_grad(*inputs):
            return self.through_custom_op(*inputs, **self.params)
        return self.run(*inputs)

    @classmethod
    def apply(cls, *inputs: Any, **params: Any) -> Any:
        """The functional API's body: plain eager calls skip the dispatcher; traced calls
        and calls that autograd must record go through the custom op."""
        if _is_compiling() or _grad_enabled() and _any_requires_grad(*inputs):
            return cls.through_custom_op(*inputs, **params)
        return cls.cached(**params).run(*inputs)

    @classmethod
    def apply_keyed(cls, inputs: tuple, key: tuple, params: Callable[[], dict[str, Any]]) -> Any:
        """`apply(*inputs, **params())` for a functional whose params give a cheap key of
        their own: `key` (their values and the types that tell equal values apart, as
        `cached` keys them) and the inputs' signature find the launch the shared instance
        settled on for them (one lookup: ~1.5 us of host time less than `apply`);
        `params()` runs on a miss and for calls through the custom op only."""
        if _is_compiling() or _grad_enabled() and _any_requires_grad(*inputs):
            return cls.through_custom_op(*inputs, **params())
        try:
            signature = cls._signature(inputs)
        except ValueError:  # not every input given
            signature = signature_of(inputs)
        except AttributeError:  # not a tensor: run() has check() say so
            signature = None
        found = (key, signature)
        launch = cls._keyed_launches.get(found)
        if launch is not None:
            return launch(*inputs)
        op = cls._keyed.get(key)
        if op is None:
            op = cls._keyed[key] = cls.cached(**params())
        result = op.run(*inputs)
        if signature is not None:
            launch = op._validated.get(signature, _NEW)  # (meta inputs are never kept)
            if launch is not _NEW:
                if len(cls._keyed_launches) >= _MAX_SIGNATURES:
                    cls._keyed_launches.clear()
                cls._keyed_launches[found] = op.forward if launch is None else launch
        return result

    @classmethod
    def through_custom_op(cls, *inputs: Any, **params: Any) -> Any:
        """`torch.ops.tileops.<name>` on inputs (input order) and params. Backward formulas
        call their backward op this way: under torch.compile's tracing of a backward only
        the custom op is opaque (`apply` would take the eager path, grad being off)."""
        return cls.torch_op(*cls._torch_op_args(inputs, params))

    @classmethod
    def register_autograd(cls, backward: Any, *, setup_context: Any = None) -> None:
        """The custom op's autograd formula, as torch.library.register_autograd takes it:
        `setup_context(ctx, inputs, output)` with the inputs in call order, and
        `backward(ctx, *grads)` returning a gradient per call-order argument. A later call
        replaces the formula."""
        cls._autograd_formula = (backward, setup_context)

    @classmethod
    def grads_in_call_order(cls, **grads: Any) -> tuple:
        """A backward formula's result: the gradients by input name, in the custom op's
        argument order, None for params and for inputs not named."""
        return tuple(grads.get(name) for name in cls.spec.call_order)

    @classmethod
    def _torch_op_args(cls, inputs: Sequence[Any], params: Mapping[str, Any]) -> list[Any]:
        """The custom op's arguments (call order) from inputs (input order) and params."""
        n_inputs = len(cls.spec.inputs)
        if len(inputs) > n_inputs:
            raise _too_many_inputs(cls.spec, len(inputs))
        inputs = [*inputs, *(None,) * (n_inputs - len(inputs))]
        return [inputs[slot] if isinstance(slot, int) else params[slot]
                for slot in cls._call_slots]

    def run(self, *inputs: Any) -> Any:
        """Validate, then launch through `forward` (the eager body of the custom op).

        Meta inputs get meta outputs (see `validate`), so they never reach `forward`.
        """
        # validate()'s fast path, inlined: a signature seen before is all most calls do
        try:
            try:
                signature = self._signature(inputs)
            except ValueError:  # not every input given
                signature = signature_of(inputs)
            launch = self._validated.get(signature, _NEW)
            if launch is not _NEW:
                self._last_signature = signature
                return self.forward(*inputs) if launch is None else launch(*inputs)
        except AttributeError:  # not a tensor: validate() has check() say so
            signature = None
        meta = self.validate(inputs)
        if meta is not None or signature is None:
            return meta if meta is not None else self.forward(*inputs)
        launch = self._validated[signature] = self.plan(*inputs)
        return self.forward(*inputs) if launch is None else launch(*inputs)

    def plan(self, *inputs: Any) -> Any:
        """A launch for every later call whose inputs have these inputs' signature (shapes,
        dtypes, devices; validated): a callable taking the inputs as `forward` does and
        returning what it returns, or None for `forward` itself. Ops whose host time
        matters return one that does only what the signature leaves open (strides,
        alignment: anything else goes to `forward`) with the kernel and sizes bound."""
        return None

    def validate(self, inputs: Sequence[Any]) -> Any:
        """Checks `inputs` for a launch; returns meta outputs for meta inputs, else None.

        Validation depends only on shapes, dtypes and devices, so a signature seen before
        skips it: host time per call is what decode-size ops are bound by. Meta inputs
        are checked on every call (their signatures are never cached).
        """
        try:
            signature = signature_of(inputs)
        except AttributeError:  # not a tensor: let check() say so
            signature = None
        if signature is None or signature not in self._validated:
            ns = self.check(inputs, require_cuda=True)
            self._last_signature = signature
            device = next(t.device for t in inputs if t is not None)
            if device.type == "meta":
                return self._meta_outputs(ns, device)
            if signature is not None:
                if len(self._validated) >= _MAX_SIGNATURES:
                    self._validated.clear()
                self._validated.setdefault(signature, None)
        self._last_signature = signature
        return None

    def forward(self, *inputs: Any) -> Any:
        raise NotImplementedError

    def check(self, inputs: Sequence[Any], require_cuda: bool = False) -> dict[str, Any]:
        """Validates the inputs against the spec; returns the expression namespace.

        Args:
            inputs: the tensors, in the manifest's input order.
            require_cuda: the inputs must all be on one CUDA device, or all on the meta
                device (a shape check); any device otherwise (fake tensors, workloads).
        """
        spec = self.spec
        name = spec.op_name
        if len(inputs) > len(spec.inputs):
            raise _too_many_inputs(spec, len(inputs))
        tensors: dict[str, Any] = {}
        device = None
        for i, t_spec in enumerate(spec.inputs):
            t = inputs[i] if i < len(inputs) else None
            if t is None:
                if not t_spec.optional:
                    raise op_error(TileOpsTypeError, name, t_spec.name, "a tensor", "None")
            elif not isinstance(t, torch.Tensor):
                raise op_error(TileOpsTypeError, name, t_spec.name, "a torch.Tensor",
                               type(t).__name__)
            elif require_cuda:
                if t.device.type not in ("cuda", "meta"):  # meta: a shape check, no launch
                    raise op_error(TileOpsValueError, name, t_spec.name, "a CUDA tensor",
                                   f"a tensor on {t.device}")
                if device is not None and t.device != device:
                    raise op_error(TileOpsValueError, name, t_spec.name,
                                   f"a tensor on {device} (like the other inputs)",
                                   f"a tensor on {t.device}")
                device = t.device
            tensors[t_spec.name] = t
        spec.check_dtypes(tensors)
        ns = spec.namespace(tensors, self.params)
        spec.check_shapes(ns)
        return ns

    @classmethod
    def index_bounds(cls, inputs: Mapping[str, Any],
                     params: Mapping[str, Any] | None = None) -> dict[str, int]:
        """{input name: n} for integer inputs that index something (class ids, positions):
        random test and benchmark inputs draw them from [0, n). `inputs` maps names to
        tensors (meta ones too), `params` the call's params (None: the defaults)."""
        return {}

    # -- derivations ----------------------------------------------------------------------
    def empty_outputs(self, ns: Mapping[str, Any], device: torch.device) -> list[torch.Tensor]:
        return [torch.empty(shape, dtype=dtype, device=device)
                for shape, dtype in self.spec.output_meta(ns)]

    def _meta_outputs(self, ns: Mapping[str, Any], device: torch.device) -> Any:
        """What `forward` returns, as empty tensors on `device` (meta or fake)."""
        note_meta_call(self, ns)  # inside prebuild.recording(): what a real call builds
        outs = self.empty_outputs(ns, device)
        return outs[0] if len(outs) == 1 else tuple(outs)

    def eval_roofline(self, *inputs: Any) -> tuple[int, int]:
        """(flops, bytes) of the given inputs, or of the last call when none are given."""
        if not inputs:
            if self._last_signature is None:
                raise TileOpsValueError(f"{self.spec.op_name}: eval_roofline() before any call")
            sig = self._last_signature  # (shape, dtype, device index) per input
            inputs = tuple(None if shape is None else torch.empty(shape, dtype=dtype,
                                                                  device="meta")
                           for shape, dtype in zip(sig[0::3], sig[1::3], strict=True))
        return self.spec.eval_roofline(self.check(inputs))

    # -- kernels --------------------------------------------------------------------------
    def get_kernel(self, dispatch_key: str, device: torch.device, **key: Any) -> Kernel:
        """The Kernel for `key` on `device`, built once per (class, key, arch, GPU, tune)."""
        # Per-instance memo first: this runs on every call, and decode calls are host-bound.
        memo_key = (dispatch_key, device, *key.values())
        kernel = self._kernel_memo.get(memo_key)
        if kernel is None:
            kernel = self._kernel_memo[memo_key] = self._shared_kernel(dispatch_key, device, key)
        return kernel

    def memo_kernel(self, memo: tuple, dispatch_key: str, device: torch.device,
                    key: Any) -> Kernel:
        """`get_kernel(dispatch_key, device, **key())`, looked up by `memo`: a tuple the
        caller builds cheaply (no dict, no keyword arguments) of everything the kernel key
        depends on, the dispatch key and the device included. `key` runs on a miss only."""
        kernel = self._call_memo.get(memo)
        if kernel is None:
            kernel = self._call_memo[memo] = self.get_kernel(dispatch_key, device, **key())
        return kernel

    def _shared_kernel(self, dispatch_key: str, device: torch.device,
                       key: dict[str, Any]) -> Kernel:
        target = target_for_device(device, self.spec.op_name)
        index = device.index if device.index is not None else torch.cuda.current_device()
        gpu = _gpu_names.get(index)
        if gpu is None:
            gpu = _gpu_names[index] = gpu_slug(torch.cuda.get_device_name(index))
        kernel_cls = self.kernel_map[dispatch_key]
        cache_key = (kernel_cls, tuple(sorted(key.items())), target["arch"], gpu, self.tune)
        kernel = Op._kernels.get(cache_key)
        if kernel is None:
            kernel = Op._kernels[cache_key] = kernel_cls(target=target, gpu=gpu,
                                                         tune=self.tune, **key)
        return kernel

    def pin_config(self, config: Any, *inputs: Any, dispatch_key: str | None = None) -> None:
        """Makes this op instance, and no other, run `config` for the kernels that `inputs`
        dispatch to (tests run every config of a space this way), or only for those under
        `dispatch_key`. The shared kernels, and so every other op, keep their tuned or
        default configs."""
        ns = self.check(inputs)
        device = next(t.device for t in inputs if isinstance(t, torch.Tensor))
        for dispatch, key, size in self.kernels_for(ns):
            if dispatch_key not in (None, dispatch):
                continue
            shared = self._shared_kernel(dispatch, device, key)
            kernel = type(shared)(target=shared.target, gpu=shared.gpu, **key)
            kernel.use(config, kernel.bucket_of(size))
            self._kernel_memo[(dispatch, device, *key.values())] = kernel
        self._call_memo.clear()
        self._validated.clear()  # launches hold their kernels
        type(self)._keyed_launches.clear()

    def kernels_for(self, ns: Mapping[str, Any]) -> list[tuple[str, dict[str, Any], int]]:
        """(dispatch key, kernel key, runtime size) of each kernel a call with `ns` runs.

        Used by the compile sweep and warmup; must agree with what `forward` launches.
        """
        raise NotImplementedError


class InPlaceByDefault:
    """Mixed in before Op by ops that update their inputs (the cache append, AdamW): an op
    object writes in place (`inplace`), as engines and optimizers want; the shared instances
    behind the pure custom op (`cached()`) return updated copies, as its schema promises."""

    inplace = True

    @classmethod
    def cached(cls, **params: Any) -> Op:
        op = super().cached(**params)  # type: ignore[misc]
        op.inplace = False
        return op


def _too_many_inputs(spec: CompiledSpec, n: int) -> TileOpsTypeError:
    return op_error(TileOpsTypeError, spec.op_name, "inputs",
                    f"at most {len(spec.inputs)} tensors {spec.input_names}", n)


def _needs_autograd(inputs: Sequence[Any]) -> bool:
    return torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in inputs)


# The dispatcher keysets below autograd (ADInplaceOrView is a fallthrough for these functional
# ops) in which the custom op's real kernel is the next one: the autograd kernel then calls it
# directly instead of redispatching (a second trip through the dispatcher from Python, ~3 us).
# Anything else there (Python modes, fake and functional tensors, meta) takes the redispatch.
_DIRECT_KEYSETS = frozenset(
    keyset.raw_repr()
    for backend in (torch._C.DispatchKey.CUDA, torch._C.DispatchKey.CPU)
    for keyset in (torch._C.DispatchKeySet(backend),
                   torch._C.DispatchKeySet(backend).add(torch._C.DispatchKey.ADInplaceOrView)))
_direct_keysets: dict[int, bool] = {}  # a call's raw keyset -> whether it is one of those
_library = torch.library.Library(LIBRARY, "FRAGMENT")


def _register_custom_op(cls: type[Op]) -> Any:
    """Defines `torch.ops.tileops.<name>` with the manifest's call order and registers its
    kernels: the real one (`Op.run` on the cached instance for the call's params), the fake
    one (also its meta kernel: the op's own check plus the output rules) and an autograd one
    that runs the formula given to `Op.register_autograd`.

    torch.library.Library's define / impl of plain functions, not torch.library.custom_op:
    the latter's Python wrappers (an autograd kernel that redispatches, an aliasing check per
    call) cost ~30 us a call on the CPU where these cost ~4 (one trip into the dispatcher).
    """
    spec = cls.spec
    name = custom_op_name(cls.__name__)
    types = {t.name: f"Tensor{'?' if t.optional else ''}" for t in spec.inputs}
    types.update((p.name, _SCHEMA_TYPES[p.type]) for p in spec.params)
    args = ", ".join(f"{types[n]} {n}" for n in spec.call_order)
    outs = ", ".join("Tensor" for _ in spec.outputs)
    schema = f"({args}) -> {outs if len(spec.outputs) == 1 else f'({outs})'}"
    input_at = [spec.call_order.index(n) for n in spec.input_names]
    # The params among the op's arguments as a hashable key (int[] arrives as a list; the
    # dispatcher gives each param its schema's Python type, so the values alone key it),
    # and the inputs in input order: one expression each, built once (~0.3 us a call).
    key_items = [f"tuple(args[{spec.call_order.index(p.name)}])" if p.type == "list[int]"
                 else f"args[{spec.call_order.index(p.name)}]" for p in spec.params]
    key_of = eval(f"lambda args: ({''.join(k + ', ' for k in key_items)})")  # noqa: S307
    inputs_of = (eval(f"lambda args: args[:{len(input_at)}]")  # noqa: S307
                 if input_at == list(range(len(input_at))) else
                 eval(f"lambda args: ({''.join(f'args[{i}], ' for i in input_at)})"))  # noqa: S307
    # Whether an input tensor requires grad, read off the schema's tensor arguments (the
    # dispatcher has parsed them: tensors, or None where optional): ~0.35 us under
    # _any_requires_grad over every argument, lists and floats included.
    grad_terms = [f"(args[{i}] is not None and args[{i}].requires_grad)"
                  if t.optional else f"args[{i}].requires_grad"
                  for i, t in zip(input_at, spec.inputs, strict=True)]
    inputs_need_grad = eval(f"lambda args: {' or '.join(grad_terms) or 'False'}")  # noqa: S307
    by_args: dict[tuple, Op] = {}

    def instance(args: tuple) -> Op:
        """The shared instance for the params among `args` (a dict hit per call)."""
        key = key_of(args)
        op = by_args.get(key)
        if op is None:
            op = by_args[key] = cls.cached(**dict(zip(spec.param_names, key, strict=True)))
        return op

    def real(*args: Any) -> Any:
        return instance(args).run(*inputs_of(args))

    def fake(*args: Any) -> Any:
        inputs = inputs_of(args)
        op = instance(args)
        ns = op.check(inputs)
        return op._meta_outputs(ns, next(t.device for t in inputs if t is not None))

    _library.define(name + schema, tags=(torch.Tag.pt2_compliant_tag,))
    torch_op = getattr(getattr(torch.ops, LIBRARY), name).default
    _library.impl(name, real, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{LIBRARY}::{name}", fake, lib=_library)

    after_autograd = torch._C._after_autograd_keyset
    grad_enabled = torch._C.is_grad_enabled

    def forward(ctx: Any, keyset: Any, *args: Any) -> Any:
        with torch._C._AutoDispatchBelowAutograd():
            result = torch_op.redispatch(keyset & after_autograd, *args)
        if cls._autograd_formula is not None and cls._autograd_formula[1] is not None:
            cls._autograd_formula[1](ctx=ctx, inputs=args, output=result)
        return result

    def backward(ctx: Any, *grads: Any) -> Any:
        if cls._autograd_formula is None:
            raise RuntimeError(f"Trying to backward through {torch_op} but no autograd "
                               f"formula was registered (Op.register_autograd).")
        needs_input_grad = ctx.needs_input_grad
        try:
            ctx.needs_input_grad = needs_input_grad[1:]  # not the keyset's
            result = cls._autograd_formula[0](ctx, *grads)
        finally:
            ctx.needs_input_grad = needs_input_grad
        return (None, *result) if isinstance(result, tuple) else (None, result)

    function = type(f"{cls.__name__}Autograd", (torch.autograd.Function,),
                    {"forward": staticmethod(forward), "backward": staticmethod(backward)})

    def autograd_kernel(keyset: Any, *args: Any) -> Any:
        if grad_enabled() and inputs_need_grad(args):
            return function.apply(keyset, *args)
        direct = _direct_keysets.get(keyset.raw_repr())
        if direct is None:
            direct = _direct_keysets[keyset.raw_repr()] = (
                (keyset & after_autograd).raw_repr() in _DIRECT_KEYSETS)
        if direct:  # real(*args), inlined
            op = by_args.get(key_of(args))
            return (op or instance(args)).run(*inputs_of(args))
        with torch._C._AutoDispatchBelowAutograd():
            return torch_op.redispatch(keyset & after_autograd, *args)

    _library.impl(name, autograd_kernel, "Autograd", with_keyset=True)
    return torch_op
