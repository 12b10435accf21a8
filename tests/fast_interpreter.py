"""Spares the Triton interpreter the work it repeats on every device-function call.

Under TRITON_INTERPRET=1 a kernel launch patches triton.language's builtins for the interpreter
(`interpreter._patch_lang`, restored after the launch), and then every call of a @triton.jit
helper inside the kernel patches them again: `inspect.getmembers` over triton.language, its
tensor and math, for attributes the launch has already replaced (a device call's patch is
never restored). Our kernels call small helpers in their loops, tl.sum / tl.max among them, so
that repetition was 42% of an interpreted layer forward+backward (cProfile, T = 64, 31.7 s).
Within a launch, once the language modules a helper's module sees have been patched, its
calls skip the patch; the first sight of each set still takes the interpreter's own path.
Only the suite's time changes: each kernel still runs through the same interpreted ops.

The interpreter also reduces an xor (`tl.standard.xor_sum`) one element at a time in Python,
its fallback for a combine function it has no numpy form of; Triton's bitonic sort, under
tl.sort and tl.topk, swaps through such reductions, so select_blocks' top-n spent 119 of a
161 s test in them (cProfile, `test_select_blocks_merges_several_tiles[R4-4]`). numpy's
`bitwise_xor.reduce` gives the same integers (xor is associative and exact) in one call.

Every interpreted op also builds its result's Triton types in Python: a block type unwraps and
validates its shape and formats its name, a tensor wraps each of its dims in a constexpr, and
the numpy dtype of a Triton type comes from a table of 19 types built on every call. Those are
functions of the type or shape alone, so they are worked out once per type or shape here
(cProfile of `test_eager_branch_backward_takes_the_gate[reference]`, 217 s: 38 s in block
types' construction, 29 s in tensors', 15 s in the dtype table). That test alone 68 -> 30 s; the
CPU suite (`python -m pytest -n 2`, this repo's 2-core machine) 17:48 -> 11:36, 37.5 -> 22.5
minutes of CPU time.
"""
import numpy as np
import triton.language as tl


def _languages(fn) -> frozenset:
    """The triton.language modules fn's module can see (what `_patch_lang` patches)."""
    return frozenset(id(value) for value in fn.__globals__.values()
                     if value is tl or value is tl.core)


def install() -> bool:
    """Wraps the interpreter's launch and patch functions; False (nothing changed) where this
    Triton's interpreter is laid out otherwise."""
    try:
        from triton.runtime import interpreter
        launch = interpreter.GridExecutor.__call__
        patch = interpreter._patch_lang
    except (ImportError, AttributeError):
        return False
    patched = []  # the languages of the launch in progress (launches do not nest)

    def launch_patching_once(self, *args, **kwargs):
        patched.append(None)  # the launch's own `_patch_lang` call comes next
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.pop()

    def patch_unless_in_place(fn):
        if not patched:  # outside a launch
            return patch(fn)
        languages = _languages(fn)
        if patched[-1] is not None and languages <= patched[-1]:
            return interpreter._LangPatchScope()  # in place already: nothing to restore
        # the launch's own call, or a helper seeing other modules (triton.language's own
        # helpers see triton.language.core): their patches stay for the rest of the launch
        patched[-1] = languages | (patched[-1] or frozenset())
        return patch(fn)

    interpreter.GridExecutor.__call__ = launch_patching_once
    interpreter._patch_lang = patch_unless_in_place
    _reduce_xor_in_numpy(interpreter)
    _types_once(interpreter)
    return True


def _reduce_xor_in_numpy(interpreter) -> None:
    """xor reductions in one numpy call where the interpreter has the layout this expects
    (`ReduceOps` with axis, keep_dims and to_tensor); left as they are otherwise."""
    reduce_ops = getattr(interpreter, "ReduceOps", None)
    xor_combine = getattr(tl.standard, "_xor_combine", None)
    if reduce_ops is None or xor_combine is None:
        return
    apply_impl = reduce_ops.apply_impl

    def apply_xor_in_numpy(self, input):
        if self.combine_fn is not xor_combine or len(input) != 1:
            return apply_impl(self, input)
        data = input[0].handle.data
        return self.to_tensor(np.bitwise_xor.reduce(data, axis=self.axis, keepdims=self.keep_dims),
                              input[0].dtype)

    reduce_ops.apply_impl = apply_xor_in_numpy


def _types_once(interpreter) -> None:
    """Block types, tensors' constexpr dims and numpy dtypes worked out once per shape or type,
    where this Triton lays them out as expected; the first sight of each takes Triton's own
    code, so a shape it refuses is refused every time."""
    core = tl.core
    get_np_dtype = getattr(interpreter, "_get_np_dtype", None)
    if get_np_dtype is not None:
        np_dtypes = {}

        def np_dtype_once(tt_dtype):
            # by name, which names the element type (block and pointer types do not hash)
            name = getattr(tt_dtype, "name", None)
            if not isinstance(name, str):
                return get_np_dtype(tt_dtype)
            found = np_dtypes.get(name)
            if found is None:
                found = np_dtypes[name] = get_np_dtype(tt_dtype)
            return found

        interpreter._get_np_dtype = np_dtype_once
    block_init = core.block_type.__init__
    blocks = {}
    # a tensor's constexpr dims by its type's shape object: block types made here share theirs
    # (Triton's shape tuples hash and compare slowly); scalars have none
    tensor_dims = {"scalar": None}

    def block_type_once(self, element_ty, shape):
        dims = tuple(d.value if type(d) is core.constexpr else d for d in shape)
        # by the element type's name, the block's name being made of it: pointer types do not hash
        name = getattr(element_ty, "name", None)
        if not isinstance(name, str) or not all(type(d) is int for d in dims):
            return block_init(self, element_ty, shape)
        key = (name, dims)
        known = blocks.get(key)
        if known is None:
            block_init(self, element_ty, shape)
            blocks[key] = (self.shape, self.numel, self.name)
            tensor_dims[id(self.shape)] = None
            return
        self.element_ty = element_ty
        self.shape, self.numel, self.name = known

    core.block_type.__init__ = block_type_once
    if "__init__" in vars(core.base_value):
        return  # tensor.__init__'s super().__init__() does something: leave tensors alone
    tensor_init = core.tensor.__init__
    other = object()

    def tensor_once(self, handle, type):
        key = id(type.shape) if type.is_block() else "scalar"
        known = tensor_dims.get(key, other)
        if known is other:  # a shape not made here: no shortcut
            return tensor_init(self, handle, type)
        if known is None:
            tensor_init(self, handle, type)
            tensor_dims[key] = (self.numel, self.shape)
            return
        self.handle = handle
        self.type = type
        self.dtype = type.scalar
        self.numel, self.shape = known

    core.tensor.__init__ = tensor_once
