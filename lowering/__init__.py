"""Inductor lowerings of the nsa ops (installed as nsa_ops.lowering).

`install()` runs when nsa_ops is imported. Importing Inductor costs seconds, so the lowerings are
registered the moment `torch._inductor.lowering` is first imported (by torch.compile, or already,
if it was imported before nsa_ops), not at nsa_ops import time.

Inductor's lowering and template APIs are private and change between torch releases. Registering
needs only `register_lowering` and `fallback_handler`; the template machinery is looked up when
the first graph is lowered (`selection.inductor_api`), when every torch module is loaded. If it is
missing, the lowering warns once and emits Inductor's generic custom-op fallback (an opaque call
of the op, which still routes by nsa_ops.routing at run time).

The extern kernels the selection lowering offers its autotuner are named in the code Inductor
writes (`extern_kernels.<name>`), which the FX graph cache runs again in later processes without
lowering anything: they are registered as soon as `torch._inductor.select_algorithm` is imported.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys

from .selection import register, register_extern_kernels_at_import, registered, unregister

__all__ = ["install", "register", "registered", "unregister"]

# Inductor module -> what runs right after it is first imported
_AFTER_IMPORT = {"torch._inductor.lowering": register,
                 "torch._inductor.select_algorithm": register_extern_kernels_at_import}


class _RunAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the real loader of one module so `then` runs right after that
    module executes."""

    def __init__(self, name: str, then) -> None:
        self.name, self.then = name, then

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_run(module):
            exec_module(module)
            self.then()
        spec.loader.exec_module = exec_then_run
        return spec


def install() -> None:
    for name, then in _AFTER_IMPORT.items():
        if name in sys.modules:
            then()
        elif not any(isinstance(f, _RunAfterImport) and f.name == name for f in sys.meta_path):
            sys.meta_path.insert(0, _RunAfterImport(name, then))
