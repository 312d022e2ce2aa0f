"""``python/flagos_shm/_core.pyi`` against the compiled module: the same public names, and for
every function and method the same parameters, in order, with the same defaults where the
binding states them (PyO3's ``__text_signature__``). A binding change that the stub does not
follow fails here, so type checkers and editors see the real API."""

import ast
import os

from flagos_shm import _core

STUB = os.path.join(os.path.dirname(_core.__file__), "_core.pyi")


def _params(fn: ast.FunctionDef):
    """``[(name, default source or None)]`` of ``fn``, without ``self``."""
    a = fn.args
    defaults = [None] * (len(a.args) - len(a.defaults)) + [ast.unparse(d) for d in a.defaults]
    return [(p.arg, d) for p, d in zip(a.args, defaults) if p.arg != "self"]


def _stub():
    """The stub's public names and ``{"f" or "Class.method": params}`` (``__init__`` as the
    class's own signature)."""
    with open(STUB) as fh:
        tree = ast.parse(fh.read())
    names, sigs = set(), {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            names.add(node.name)
            sigs[node.name] = _params(node)
        elif isinstance(node, ast.ClassDef):
            names.add(node.name)
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and not any(
                        isinstance(d, ast.Name) and d.id == "property" for d in item.decorator_list):
                    sigs[f"{node.name}.{item.name}"] = _params(item)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {n for n in names if not n.startswith("_") or n == "__version__"}, sigs


def _runtime(key):
    """The binding's params of ``key`` from PyO3's ``__text_signature__``, or None."""
    owner, _, attr = key.rpartition(".")
    obj = getattr(_core, owner) if attr == "__init__" else getattr(getattr(_core, owner), attr) if owner \
        else getattr(_core, attr)
    text = getattr(obj, "__text_signature__", None)
    if not text:
        return None
    text = text.replace("$self, ", "").replace("$self", "").replace("$type, ", "")
    return _params(ast.parse(f"def f{text}: pass").body[0])


def test_the_stub_names_what_the_module_has():
    names, _ = _stub()
    public = {n for n in dir(_core) if not n.startswith("_") or n == "__version__"}
    assert names == public, f"only in the stub: {sorted(names - public)}; only in _core: {sorted(public - names)}"


def test_every_signature_in_the_stub_matches_the_binding():
    _, sigs = _stub()
    checked = 0
    for key, want in sigs.items():
        got = _runtime(key)
        assert got is not None, f"{key}: the binding publishes no signature"
        assert got == want, f"{key}: binding {got}, stub {want}"
        checked += 1
    assert checked >= 35, f"only {checked} signatures compared"


def test_the_package_is_typed():
    assert os.path.exists(os.path.join(os.path.dirname(_core.__file__), "py.typed"))
