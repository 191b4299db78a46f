"""The one loader for user code named in configs and flags: environments, agents, tools, plugins, rewards and
schedulers, by module (`pkg.module`, `pkg.module:attr`) or by file (`path/file.py`, `path/file.py:attr`).

A file is imported under a name derived from its resolved path, `turnrl_user_<stem>_<sha1(path)[:12]>`, so
every process (Ray workers, rollout servers) gives it the same name and pickled references to its classes
resolve there too. Each file runs once per process, however it is named (relative or absolute path, as a
plugin and as a tool file, or already imported by a sibling's `import`). Its folder goes on `sys.path`
(appended, once) so it can import its siblings (`from base_env import X`); when the file lies under the
current directory, so does that directory, which makes slime's layout work from the console script
(`examples/geo3k/env.py` doing `from examples.geo3k.base_env import X`, run from the repo root): Python adds
the current directory only under `python -m`. For the same reason a dotted module that is not on `sys.path` but
lies in a package of the current directory (slime's YAML names `examples.geo3k.env`) is imported from there.

A failed load leaves nothing half-imported in `sys.modules`, and its error names the file or module, what it
was loaded as (`what`) and what was missing:
    FileNotFoundError    the file does not exist
    ModuleNotFoundError  the named module does not exist
    AttributeError       the module has no such attribute, or it is not callable (the error lists what it has)
    LoadError            a syntax error (file:line) or a failed import inside the file
    anything else        raised by the file's own code, with a note naming the file
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import re
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import Any

_LOCK = threading.RLock()  # one thread executes a given file; the others then find it in sys.modules


class LoadError(ImportError):
    """User code could not be imported: a syntax error, or an import inside it failed."""


def load_object(spec: str, what: str = "object", expected: str | None = None) -> Any:
    """The callable named by `pkg.module:attr` or `path/file.py:attr` (a function or class). `expected`
    describes it in the error when it is missing (e.g. "build_env(sample, config) function")."""
    module_spec, attr = split_object_spec(spec, what)
    module = load_module(module_spec, what)
    obj = getattr(module, attr, _MISSING)
    if obj is _MISSING or not callable(obj):
        problem = f"no {expected or f'attribute {attr!r}'}"
        if obj is not _MISSING:
            problem = f"a {type(obj).__name__} named {attr!r}, not a function or class"
        raise AttributeError(f"{what} {spec!r}: {_where(module)} has {problem}; {_public_callables(module)}")
    return obj


def split_object_spec(spec: str, what: str = "object") -> tuple[str, str]:
    """`pkg.module:attr` / `path/file.py:attr` → (module or file, attr)."""
    module_spec, sep, attr = spec.rpartition(":")
    if not sep or not module_spec or not attr.isidentifier():
        raise ValueError(f"{what} {spec!r}: expected path/file.py:name or package.module:name")
    return module_spec, attr


def is_file_spec(spec: str) -> bool:
    """Whether `spec` names a file (ends in .py or has a path separator) rather than a dotted module."""
    return spec.endswith(".py") or "/" in spec or os.sep in spec


def load_module(spec: str, what: str = "module") -> ModuleType:
    """Import a dotted module path or a `.py` file path (see the module docstring)."""
    if is_file_spec(spec):
        return _load_file(Path(spec), what)
    try:
        return _import_dotted(spec)
    except ModuleNotFoundError as e:
        if e.name and (spec == e.name or spec.startswith(e.name + ".")):
            raise ModuleNotFoundError(
                f"{what} {spec!r}: cannot import module {e.name!r} (not installed, and not found on sys.path)",
                name=e.name,
            ) from None
        raise LoadError(f"{what} {spec!r}: an import inside it failed: {e}", name=spec) from e
    except SyntaxError as e:
        raise LoadError(f"{what} {spec!r}: {_syntax(e)}", name=spec) from None
    except Exception as e:
        e.add_note(f"raised while importing {what} module {spec!r}")
        raise


def _import_dotted(spec: str) -> ModuleType:
    """`importlib.import_module`, retried with the current directory on sys.path when the module's top package is
    missing from sys.path but is a folder of the current directory (a console script does not put it there)."""
    try:
        return importlib.import_module(spec)
    except ModuleNotFoundError as e:
        missing_itself = bool(e.name) and (spec == e.name or spec.startswith(f"{e.name}."))
        cwd = str(Path.cwd().resolve())
        top = spec.partition(".")[0]
        # only a package path (`examples.x.env`): a bare name that is a file here is better answered with a hint.
        # The directory may be on sys.path already: another thread appended it after this import failed (env
        # factories load on threads), so the import is retried under the lock either way.
        if not missing_itself or "." not in spec or not Path(cwd, top).is_dir():
            raise
    with _LOCK:
        added = cwd not in sys.path
        if added:
            sys.path.append(cwd)
        importlib.invalidate_caches()
        try:
            return importlib.import_module(spec)
        except BaseException:
            if added and cwd in sys.path:  # leave sys.path as it was
                sys.path.remove(cwd)
            raise


def module_name_for(path: Path) -> str:
    """The stable module name of a user file: the same in every process for the same resolved path."""
    resolved = path.resolve()
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:12]
    return f"turnrl_user_{re.sub(r'[^0-9A-Za-z_]', '_', resolved.stem)}_{digest}"


def _load_file(path: Path, what: str) -> ModuleType:
    resolved = path.resolve()
    if not resolved.is_file():
        shown = str(path) if str(path) == str(resolved) else f"{path} (resolved to {resolved})"
        raise FileNotFoundError(f"{what} file {shown} does not exist")
    name = module_name_for(resolved)
    with _LOCK:
        module = sys.modules.get(name) or _imported_elsewhere(resolved)
        if module is not None:
            return module
        added = _make_importable(resolved)
        try:
            return _exec_file(name, resolved, what)
        except BaseException:
            for folder in added:  # leave sys.path as it was, too
                sys.path.remove(folder)
            raise


def _exec_file(name: str, path: Path, what: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise LoadError(f"{what} file {path}: not importable as a Python module", path=str(path))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before exec: dataclasses, typing and pickle look the module up by name
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:
        _forget(name, module)
        raise LoadError(f"{what} file {path}: {_syntax(e)}", path=str(path)) from None
    except ImportError as e:
        _forget(name, module)
        raise LoadError(f"{what} file {path}: an import inside it failed: {e}{_import_hint(e, path)}",
                        path=str(path)) from e
    except BaseException as e:
        _forget(name, module)
        if isinstance(e, Exception):
            e.add_note(f"raised while loading {what} file {path}")
        raise
    return module


def _forget(name: str, module: ModuleType) -> None:
    if sys.modules.get(name) is module:
        del sys.modules[name]


def _imported_elsewhere(resolved: Path) -> ModuleType | None:
    """The module already imported from this file under another name (a sibling's `import base_env`, a
    package import), so that loading it by path does not run it a second time."""
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if isinstance(file, str) and file.endswith(resolved.name) and Path(file).resolve() == resolved:
            return module
    return None


def _make_importable(resolved: Path) -> list[str]:
    """Append the file's folder (and the current directory, when the file lies under it) to sys.path."""
    folders = [str(resolved.parent)]
    cwd = Path.cwd().resolve()
    if resolved.is_relative_to(cwd) and cwd != Path(cwd.anchor):
        folders.append(str(cwd))
    added = []
    for folder in folders:
        if folder not in sys.path and folder not in added:
            sys.path.append(folder)
            added.append(folder)
    return added


def _syntax(e: SyntaxError) -> str:
    return f"syntax error at {e.filename}:{e.lineno}: {e.msg}"


def _import_hint(e: ImportError, path: Path) -> str:
    if not isinstance(e, ModuleNotFoundError):
        return ""
    return (f" (the file's folder {path.parent} is importable, so siblings load as `import name`; "
            "`from pkg.module import x` needs the folder above pkg on PYTHONPATH or as the current directory)")


def _where(module: ModuleType) -> str:
    return getattr(module, "__file__", None) or module.__name__


def _public_callables(module: ModuleType) -> str:
    names = sorted(
        n for n, v in vars(module).items()
        if not n.startswith("_") and callable(v) and getattr(v, "__module__", None) == module.__name__
    )
    return f"it defines {', '.join(names)}" if names else "it defines no public function or class"


_MISSING = object()
