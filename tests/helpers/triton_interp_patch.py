"""Triton's interpreter (``TRITON_INTERPRET=1``, the emulated device) without work whose result it never uses:
its redundant re-patching of ``triton.language`` and its integer overflow checks whose verdict it drops
(:func:`_skip_discarded_overflow_checks`), and with answers it derives again and again kept once derived
(:func:`_memoize_numpy_dtypes`, :func:`_convert_small_floats_by_table`, :func:`_memoize_block_shapes`,
:func:`_keep_builtin_lists`), and with a lighter wrapper of each builtin (:func:`_lighter_builtin_wrappers`).
Each computes exactly what Triton's own code computes.

Every launch of a kernel patches ``triton.language`` for the interpreter (``interpreter._patch_lang``:
``inspect.getmembers`` over ``tl``, ``tl.core``, ``tl.math``, ``tl.tensor``... replacing each builtin by a
wrapper) and restores it when the launch ends. Every call of a ``@triton.jit`` device function inside
that kernel patches again (and never restores): the builtins are wrappers already, so that pass only
walks every member again and replaces the few unconditional patches (``tl.range``...) by equivalent
new closures. Profiled on the emulated-device tests that re-walk was about a fifth of their time.

:func:`install` skips that pass where it cannot change anything: a device function called while a
launch is in progress whose ``triton.language`` modules (the ones ``_patch_lang`` would patch) are
among those patched since the launch began (by the launch, or left patched by an earlier device call
of it). Everything else (the launch's own patch and its restore, the first call of a device function
that sees a module not patched yet, a call outside a launch) goes to Triton's own code unchanged. Where Triton's internals are not the ones this was written against, nothing is
installed and the interpreter runs as shipped.
"""

from __future__ import annotations

import inspect

_INSTALLED = "_streamring_tests_patch_lang_memo"
KEPT_SCALARS = 1 << 16  # one-element float conversions kept (:func:`_convert_small_floats_by_table`)


class _NoRestore:
    """The scope of a skipped pass: nothing was patched, so nothing to restore."""

    def restore(self) -> None:
        pass


def install() -> bool:
    """Wrap ``triton.runtime.interpreter._patch_lang`` (module docstring); True if installed (or already)."""
    try:
        from triton.runtime import interpreter as interp
    except Exception:  # no Triton, or one that fails to import here: nothing to speed up
        return False
    if getattr(interp, _INSTALLED, False):
        return True
    original = getattr(interp, "_patch_lang", None)
    grid = getattr(interp, "GridExecutor", None)
    tl = getattr(interp, "tl", None)
    if (original is None or grid is None or tl is None or not hasattr(tl, "core")
            or list(inspect.signature(original).parameters) != ["fn"]
            or not callable(getattr(grid, "__call__", None))):
        return False
    langs_of = [tl, tl.core]
    state = {"launching": False, "patched": None}  # a launch in progress; the modules its patch covers
    langs_of_globals = {}  # id of a globals dict -> (the dict, its length, the modules _langs found in it)

    def _langs(fn) -> frozenset:
        # the modules _patch_lang patches for fn (its own test: a module of fn's globals equal to tl or tl.core),
        # found again when fn's globals dict gains or loses a name (a module binds its imports once; the
        # interpreter adds its own names at a function's first rewrite)
        g = fn.__globals__
        seen = langs_of_globals.get(id(g))
        if seen is None or seen[0] is not g or seen[1] != len(g):
            langs = frozenset(id(v) for v in g.values() if inspect.ismodule(v) and v in langs_of)
            seen = langs_of_globals[id(g)] = (g, len(g), langs)
        return seen[2]

    def _patch_lang(fn):
        patched, langs = state["patched"], _langs(fn)
        if patched is not None and langs and langs <= patched:
            return _NoRestore()
        scope = original(fn)  # (asserts that fn sees triton.language)
        if state["launching"]:
            # the launch's own patch (GridExecutor.__call__), or a device function that sees a module the
            # launch did not patch (triton.language.standard's tl.sum, tl.zeros... see tl.core): Triton
            # leaves that patch in place (a device call's scope is never restored), so it covers the
            # launch's later calls too
            state["patched"] = langs if patched is None else patched | langs
        return scope

    grid_call = grid.__call__

    def __call__(self, *args, **kwargs):
        if state["launching"]:  # (a launch inside a launch: Triton's own path, nothing assumed)
            return grid_call(self, *args, **kwargs)
        state["launching"] = True
        try:
            return grid_call(self, *args, **kwargs)
        finally:  # (after grid_call restored its patch)
            state["launching"] = False
            state["patched"] = None

    interp._patch_lang = _patch_lang
    grid.__call__ = __call__
    _skip_discarded_overflow_checks(interp)
    _memoize_numpy_dtypes(interp)
    _convert_small_floats_by_table(interp)
    _memoize_block_shapes(tl.core)
    _keep_builtin_lists(interp)
    _lighter_builtin_wrappers(interp)
    setattr(interp, _INSTALLED, True)
    return True


def _skip_discarded_overflow_checks(interp) -> None:
    """The integer overflow check of every int32 ``+ - *`` without its work where its verdict is dropped.

    ``TritonSemantic.binary_op_sanitize_overflow_impl`` recomputes the operation in int64, compares it with the
    type's range and hands the result to ``device_assert``, which discards it unless the options ask for
    ``debug`` (the interpreter's never do: ``InterpreterOptions()``): no error is raised, nothing is stored, and
    the work was about a quarter of the emulated kernels' time. Here the check returns at once when ``debug``
    is off and runs as shipped when it is on. Installed on the interpreter's own semantic object only (the
    compiler's are other instances)."""
    semantic = getattr(interp, "interpreter_semantic", None)
    check = getattr(semantic, "binary_op_sanitize_overflow_impl", None)
    if check is None or list(inspect.signature(check).parameters) != ["lhs", "rhs", "binary_op"]:
        return
    try:  # a device_assert that drops its verdict without debug never looks at the condition
        dropped = not semantic.builder.options.debug and semantic.device_assert(None, "", None) is None
    except Exception:
        dropped = False
    if not dropped:
        return

    def binary_op_sanitize_overflow_impl(lhs, rhs, binary_op):
        if not semantic.builder.options.debug:
            return None
        return check(lhs, rhs, binary_op)

    semantic.binary_op_sanitize_overflow_impl = binary_op_sanitize_overflow_impl


def _memoize_numpy_dtypes(interp) -> None:
    """``_get_np_dtype`` (the numpy dtype that holds a Triton type, asked by nearly every interpreted op) builds
    its table of every type on each call: here a scalar type's answer is kept after Triton's code first gives
    it. A block type gets its element type's (as in Triton's lookup); a pointer goes to Triton's code."""
    tl, original = interp.tl, getattr(interp, "_get_np_dtype", None)
    if original is None or list(inspect.signature(original).parameters) != ["tt_dtype"]:
        return
    known = {}

    def _get_np_dtype(tt_dtype):
        if isinstance(tt_dtype, tl.block_type):
            tt_dtype = tt_dtype.element_ty
        if isinstance(tt_dtype, tl.pointer_type):
            return original(tt_dtype)
        np_dtype = known.get(tt_dtype)
        if np_dtype is None:
            np_dtype = known[tt_dtype] = original(tt_dtype)
        return np_dtype

    _get_np_dtype.__wrapped__ = original
    interp._get_np_dtype = _get_np_dtype


def _convert_small_floats_by_table(interp) -> None:
    """``_convert_float`` (the interpreter's bit-exact float conversion: the FP8 operands of every ``tl.dot`` to
    fp16, bf16 to fp32 and back, every float constant of a bf16 op...) derives sign, exponent and mantissa of
    every element in numpy. A conversion from 8 or 16 bits has at most 65536 inputs: here Triton's own function
    converts all of them once per (from, to, rounding) and each later input is looked up, the same bits element
    by element (the conversion is elementwise). A one-element input of more bits (a constant: ``other=0.0`` of
    a bf16 load...) is converted by Triton's function once per value and kept (up to ``KEPT_SCALARS`` values);
    other wider inputs (fp32 rows down to bf16 or FP8) go to Triton's code."""
    np, original = interp.np, getattr(interp, "_convert_float", None)
    if original is None or list(inspect.signature(original).parameters) != [
            "input", "input_dtype", "output_dtype", "rounding_mode"]:
        return
    tables, scalars = {}, {}

    def _convert_float(input, input_dtype, output_dtype, rounding_mode):
        bits = input_dtype.primitive_bitwidth
        if bits not in (8, 16) or input.dtype.itemsize * 8 != bits:
            if input.size != 1 or input.dtype.itemsize * 8 != bits:
                return original(input, input_dtype, output_dtype, rounding_mode)
            key = (input.tobytes(), input_dtype.name, output_dtype.name, rounding_mode)
            out = scalars.get(key)
            if out is None:
                out = original(input, input_dtype, output_dtype, rounding_mode)
                if len(scalars) < KEPT_SCALARS:
                    scalars[key] = out.reshape(-1).copy()
                return out
            return out.reshape(input.shape).copy()
        code_dtype = np.uint8 if bits == 8 else np.uint16
        key = (input_dtype.name, output_dtype.name, rounding_mode)
        table = tables.get(key)
        if table is None:
            table = tables[key] = original(np.arange(1 << bits, dtype=code_dtype), input_dtype, output_dtype,
                                           rounding_mode)
        return table[np.ascontiguousarray(input).view(code_dtype)].reshape(input.shape)

    _convert_float.__wrapped__ = original
    interp._convert_float = _convert_float


def _memoize_block_shapes(core) -> None:
    """The shape of every ``tl.block_type`` and ``tl.tensor`` (made by nearly every interpreted op) without
    re-deriving it: Triton's constructors unwrap and validate the dimensions, count the elements and build a
    ``tl.tuple`` whose type lists every dimension, each time. Here a shape of Python ints is laid out once by
    Triton's own ``block_type`` constructor (which raises for a bad one as it always does) and each later
    block type or tensor of that shape gets equal attributes from it (its shape a fresh ``tl.tuple`` of shared
    immutable parts), a scalar tensor those of the scalar Triton's constructor made. Other shapes go to Triton's
    constructors. Installed only where the results equal Triton's (:func:`_same_shapes`)."""
    block_type, tensor, tl_tuple, constexpr = core.block_type, core.tensor, core.tuple, core.constexpr
    triton_block_init, triton_tensor_init = block_type.__init__, tensor.__init__
    shapes = {}  # dims (a tuple of ints) -> (element count, as constexpr, the dims as constexprs, tuple type, str)
    scalar = tensor.__new__(tensor)
    triton_tensor_init(scalar, None, core.int32)
    scalar_shape = (scalar.numel, scalar.shape.values, scalar.shape.type)  # (a scalar's: no dims, one element)

    def _laid_out(dims):
        known = shapes.get(dims)
        if known is None:
            probe = block_type.__new__(block_type)
            triton_block_init(probe, core.int32, list(dims))
            known = shapes[dims] = (probe.numel, constexpr(probe.numel), [constexpr(d) for d in dims],
                                    probe.shape.type, str(probe.shape))
        return known

    def block_type_init(self, element_ty, shape):
        dims = _int_dims(shape, tl_tuple)
        if not dims:
            return triton_block_init(self, element_ty, shape)
        numel, _, _, dims_type, text = _laid_out(dims)
        self.element_ty = element_ty
        self.shape = tl_tuple(list(dims), dims_type)
        self.numel = numel
        self.name = f"<{text}, {element_ty}>"

    def tensor_init(self, handle, type):
        if type.is_block():
            dims = _int_dims(type.shape, tl_tuple)
            if not dims:
                return triton_tensor_init(self, handle, type)
            _, numel, dim_values, dims_type, _ = _laid_out(dims)
        else:
            numel, dim_values, dims_type = scalar_shape
        self.handle = handle
        self.numel = numel
        self.type = type
        self.dtype = type.scalar
        self.shape = tl_tuple(list(dim_values), dims_type)

    block_type_init.__wrapped__, tensor_init.__wrapped__ = triton_block_init, triton_tensor_init
    block_type.__init__, tensor.__init__ = block_type_init, tensor_init
    if not _same_shapes(core, triton_block_init, triton_tensor_init):
        block_type.__init__, tensor.__init__ = triton_block_init, triton_tensor_init


def _int_dims(shape, tl_tuple):
    """``shape`` (a list or a ``tl.tuple``, as Triton's constructors take it) as a tuple of Python ints, or None
    if it is anything else or holds anything else."""
    values = shape.values if type(shape) is tl_tuple else shape if type(shape) is list else None
    if values is None:
        return None
    for v in values:
        if type(v) is not int:
            return None
    return tuple(values)


def _same_shapes(core, triton_block_init, triton_tensor_init,
                 shapes=([16], [16, 128], [1, 128], [4, 2, 8])) -> bool:
    """Block types and tensors of ``shapes`` made by the installed constructors and by Triton's: the same
    attributes (compared by value, and by their text), or the same error."""
    def made(cls, init, *args):
        try:
            obj = cls.__new__(cls)
            init(obj, *args)
        except Exception as e:
            return repr(e)
        return {k: (type(v), str(v), getattr(v, "type", None), v) for k, v in vars(obj).items()}

    try:
        for dims in shapes:
            for element in (core.int32, core.float8e4nv, core.pointer_type(core.bfloat16)):
                if made(core.tensor, core.tensor.__init__, None, element) != made(core.tensor, triton_tensor_init,
                                                                                 None, element):
                    return False
                ours = made(core.block_type, core.block_type.__init__, element, dims)
                if ours != made(core.block_type, triton_block_init, element, dims):
                    return False
                if isinstance(ours, dict):
                    ty = core.block_type(element, dims)
                    if made(core.tensor, core.tensor.__init__, None, ty) != made(core.tensor, triton_tensor_init,
                                                                                None, ty):
                        return False
    except Exception:  # (a comparison Triton's objects refuse)
        return False
    return True


def _keep_builtin_lists(interp) -> None:
    """The builtins each launch wraps for the interpreter (``_patch_builtin`` of ``tl``, ``tl.core``, ``tl.math``,
    ``tl.tensor``...: every member ``tl.core.is_builtin`` names) without walking the package each time
    (``inspect.getmembers``: sorting and reading every attribute, most of a launch's own cost). A package's list
    of (name, builtin), in Triton's order, is taken from its first walk, before anything wrapped one of its
    builtins (every wrapping goes through here). After it a name on the list holds its builtin or a wrapper
    (a launch's, restored when the launch ends; a device function's scope, which Triton never restores; the
    other name of one class: ``tl.tensor`` is ``tl.core.tensor``), and no other name gets a builtin; so the
    builtins a walk would find now are the names on the list that hold theirs, and each of those is wrapped by
    ``_patch_attr`` as Triton's own loop does."""
    original = getattr(interp, "_patch_builtin", None)
    if (original is None or not callable(getattr(interp, "_patch_attr", None))
            or list(inspect.signature(original).parameters) != ["pkg", "builder", "scope"]
            or not callable(getattr(interp.tl.core, "is_builtin", None))):
        return
    is_builtin, kept = interp.tl.core.is_builtin, {}

    def _patch_builtin(pkg, builder, scope):
        members = kept.get(pkg)
        if members is None:
            members = kept[pkg] = [(name, member) for name, member in inspect.getmembers(pkg) if is_builtin(member)]
        for name, member in members:
            if getattr(pkg, name, None) is member:
                interp._patch_attr(pkg, name, member, builder, scope)

    _patch_builtin.__wrapped__ = original
    interp._patch_builtin = _patch_builtin


def _lighter_builtin_wrappers(interp) -> None:
    """The wrapper ``_patch_attr`` puts around each builtin for a launch (it hands the builtin the interpreter's
    semantic object in place of any ``_semantic`` the caller passed), called for nearly every interpreted op,
    without building a filtered copy of the keyword arguments on every call: the caller's ``_semantic`` is
    dropped from the call's own keyword dict. (Triton's wrapper also takes a ``member`` keyword, its own
    default argument, which no builtin has.)"""
    original = getattr(interp, "_patch_attr", None)
    semantic = getattr(interp, "interpreter_semantic", None)
    if original is None or semantic is None or list(inspect.signature(original).parameters) != [
            "obj", "name", "member", "builder", "scope"]:
        return

    def _patch_attr(obj, name, member, builder, scope):
        def new_member(*args, **kwargs):
            kwargs.pop("_semantic", None)
            return member(*args, **kwargs, _semantic=semantic)

        scope.set_attr(obj, name, new_member)

    _patch_attr.__wrapped__ = original
    interp._patch_attr = _patch_attr
