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
