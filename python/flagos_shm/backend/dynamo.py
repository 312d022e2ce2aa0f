"""Keep ``torch.compile`` (TorchDynamo) out of flagos_shm's own Python code.

torch calls flagos_shm's Python (the group's collectives, staging, works) from C++ in the
middle of a compiled region too: ``torch.compile(DDP(model))`` runs DDP's first-step bucket
rebuild (a ``broadcast``) inside the compiled module's call, and on a device whose tensors
are staged that broadcast runs in Python. Dynamo intercepts every Python frame entered
while a compiled region runs, and it traced flagos_shm's staging code as a function to
compile; the graph it made raised ``RuntimeError: self.size(-1) must be divisible by 4 to
view Byte as Int`` at the first compiled step (torch 2.10 and 2.15, emulated ``flagos``
device). A backend written in C++ (Gloo) has no Python frames to trace.

:func:`hide` marks the code of every function of flagos_shm's runtime modules (and the
functions nested in them) as *skipped, recursively*: Dynamo runs those frames, and the
frames they call, as plain Python. It is a flag on each code object, no cost per call: the
mechanism torch uses for its own markers (``torch/_dynamo/utils.py``,
``_pregraph_marker_skip``), through ``torch._C._dynamo.eval_frame`` so that
``torch._dynamo`` (seconds to import) is not imported. The C-level API exists on every
supported torch (2.10 to 2.15); where it is missing, :func:`hide` does nothing.
"""

from __future__ import annotations

import sys
import types

import torch

__all__ = ["hide"]

#: Modules not part of the runtime: tools that are never called from a compiled region.
_TOOLS = ("flagos_shm.bench", "flagos_shm.demo", "flagos_shm._launch")

_done: set = set()  # names of the modules already marked


def _skip_recursively():
    """``set_code_exec_strategy`` and the (SKIP, SKIP) strategy, or None without the API."""
    eval_frame = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)
    action = getattr(eval_frame, "_FrameAction", None)
    strategy = getattr(eval_frame, "_FrameExecStrategy", None)
    setter = getattr(eval_frame, "set_code_exec_strategy", None)
    if action is None or strategy is None or setter is None:
        return None
    skip = strategy(action.SKIP, action.SKIP)
    return lambda code: setter(code, skip)


def _codes(obj, module: str):
    """The code objects of ``obj`` (a function, or a class's functions, static and class
    methods and property accessors) if it was defined in ``module``."""
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    if isinstance(obj, property):
        for f in (obj.fget, obj.fset, obj.fdel):
            yield from _codes(f, module)
    elif isinstance(obj, types.FunctionType) and obj.__module__ == module:
        yield obj.__code__
    elif isinstance(obj, type) and obj.__module__ == module:
        for member in vars(obj).values():
            yield from _codes(member, module)


def _with_nested(code: types.CodeType):
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _with_nested(const)


def hide() -> int:
    """Mark every function of the ``flagos_shm`` modules loaded so far (not the tools:
    bench, demo, launcher) as skipped by Dynamo, recursively (see the module docstring).
    Idempotent and cheap: modules marked before are passed over. Called at ``import
    flagos_shm`` and again when a group is created (modules loaded lazily since).

    Returns:
        the number of code objects marked by this call (0 without the torch API).
    """
    mark = _skip_recursively()
    if mark is None:
        return 0
    count = 0
    for name, module in list(sys.modules.items()):
        if (name in _done or module is None or not (name == "flagos_shm" or name.startswith("flagos_shm."))
                or name.startswith(_TOOLS)):
            continue
        _done.add(name)
        for obj in list(vars(module).values()):
            for code in _codes(obj, name):
                for inner in _with_nested(code):
                    mark(inner)
                    count += 1
    return count
