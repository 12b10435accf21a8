"""Inductor lowerings of the nsa ops (installed as nsa_ops.lowering).

`install()` runs when nsa_ops is imported. Importing Inductor costs seconds, so the lowerings are
registered the moment `torch._inductor.lowering` is first imported (by torch.compile, or already,
if it was imported before nsa_ops), not at nsa_ops import time.

Inductor's lowering and template APIs are private and change between torch releases. Registering
needs only `register_lowering` and `fallback_handler`; the template machinery is looked up when
the first graph is lowered (`selection.inductor_api`), when every torch module is loaded. If it is
missing, the lowering warns once and emits Inductor's generic custom-op fallback (an opaque call
of the op, which still routes by nsa_ops.routing at run time).
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys

from .selection import register, registered, unregister

__all__ = ["install", "register", "registered", "unregister"]

_INDUCTOR_LOWERING = "torch._inductor.lowering"


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the real loader of torch._inductor.lowering so `register`
    runs right after that module executes."""

    def find_spec(self, name, path, target=None):
        if name != _INDUCTOR_LOWERING:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            register()
        spec.loader.exec_module = exec_then_register
        return spec


def install() -> None:
    if _INDUCTOR_LOWERING in sys.modules:
        register()
    elif not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())
