"""Run the Triton kernels in Triton's CPU interpreter.

``@triton.jit`` picks interpreter vs. GPU compiler when a function is
decorated, i.e. when its module is imported.  That matters for two sets of
functions:

* our kernels (``triton_kernels.*``), and
* Triton's own ``@jit`` standard library (``tl.sum``, ``tl.max``, ``tl.zeros``,
  ...), decorated when ``triton.language`` is first imported.  ``import vllm``
  imports triton, so any test module collected before this directory that
  imports vllm (or anything importing triton) freezes them as GPU functions,
  and interpreted kernels then fail with "Cannot call @triton.jit'd outside of
  the scope of a kernel".

Setting the variable here covers the normal case.  If triton or our modules
were imported earlier, they are reloaded below so they get re-decorated for
the interpreter.  The clean fix for a full-suite run is to set
``TRITON_INTERPRET=1`` before anything imports triton: in the environment or
at the top of ``tests/conftest.py`` (CPU-only vLLM doesn't use triton, and
the plugin's dispatchers launch interpreter kernels on CPU tensors only
where ``SPECPLUG_INTERPRET_ON_CPU`` is set: below, for these tests alone).
"""

import importlib
import os
import sys

import pytest  # doesn't import triton

os.environ["TRITON_INTERPRET"] = "1"

# `pytest` (unlike `python -m pytest`) doesn't put the repo root on sys.path.
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)


def _reinterpret_triton_stdlib() -> None:
    tl = sys.modules.get("triton.language")
    if tl is None:
        return  # triton not imported yet: it will see the variable
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    if isinstance(tl.standard.sum, InterpretedFunction):
        return
    for mod in (tl.standard, tl.random):
        importlib.reload(mod)  # re-registers tensor member fns (x.sum()) too
        for name, value in list(vars(tl).items()):
            if isinstance(value, JITFunction) and hasattr(mod, name):
                setattr(tl, name, getattr(mod, name))  # `from .standard import` copies


_reinterpret_triton_stdlib()
for _name in sorted(m for m in sys.modules
                    if m.startswith(("triton_kernels.", "vllm_specplug.kernels."))):
    importlib.reload(sys.modules[_name])



@pytest.fixture(autouse=True)
def interpret_on_cpu(monkeypatch):
    """The kernels' dispatchers launch the interpreter kernels on CPU
    tensors during these tests only: engines in the other test directories
    run the torch path CPU users run."""
    from vllm_specplug.kernels import INTERPRET_ON_CPU

    monkeypatch.setenv(INTERPRET_ON_CPU, "1")


@pytest.fixture
def reversed_programs(monkeypatch):
    """Make the interpreter run a launch's programs in reverse grid order.

    The interpreter runs programs one after another in grid order, which hides
    ordering bugs (e.g. a "last duplicate wins" that relies on later programs
    writing later).  A GPU guarantees no order, so results must survive this.
    """
    from triton.runtime import interpreter

    builder = getattr(interpreter, "interpreter_builder", None)
    if builder is None or not hasattr(builder, "set_grid_idx"):
        pytest.skip("this Triton's interpreter has no grid-index hook")
    set_idx = builder.set_grid_idx

    def flipped(x, y, z):
        nx, ny, nz = builder.grid_dim
        set_idx(nx - 1 - x, ny - 1 - y, nz - 1 - z)

    monkeypatch.setattr(builder, "set_grid_idx", flipped)
