"""Where a factory model's function comes from (`model: {source: factory, target: ...}`, `--model module:function`).

A target is
  `module:function`: a module Python can import, or one whose file (or package folder) is in the working folder or
    the recipe's folder: a model file beside the user needs no PYTHONPATH, whichever way `optimizer` was started
    (the console script's sys.path holds no working folder; `python -m` adds it);
  `path/to/file.py:function`: that file, relative to the recipe's folder (the working folder for `--model`; the
    generated recipe then names it by its absolute path).

While the module is imported its folder comes first on sys.path (its own imports of the files beside it work as
when it is run as a script); afterwards the folder stays at the end of sys.path, so that what the module imports
later, and the child processes started with this process's path (runtime/childpath.py: the memory probe,
workers), find it too. Every process resolves a target the same way, from the same recipe.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import os
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from optimizer.core.errors import OptimizerError

# module name -> the folder (the working folder or the recipe's) it was found in, not on Python's own path
FOUND_BESIDE: dict[str, Path] = {}
FUNCTION = r"[A-Za-z_]\w*"
MODULE_TARGET = re.compile(rf"[A-Za-z_][\w.]*:{FUNCTION}")
FILE_TARGET = re.compile(rf".+\.py:{FUNCTION}")


def is_target(text: str) -> bool:
    """Whether `text` reads as a factory target (`module:function` or `path/to/file.py:function`)."""
    return bool(MODULE_TARGET.fullmatch(text) or FILE_TARGET.fullmatch(text))


def split(target: str) -> tuple[str, str]:
    module, _, function = target.rpartition(":")
    return module, function


def is_file(module: str) -> bool:
    """A target's module part names a file (`models/net.py`), not a module (`models.net`)."""
    return module.endswith(".py") or "/" in module or os.sep in module


def file_path(module: str, base_dir: Path | None) -> Path:
    path = Path(module).expanduser()
    return path if path.is_absolute() else (base_dir or Path.cwd()) / path


@contextlib.contextmanager
def _first_on_path(folder: str) -> Iterator[None]:
    sys.path.insert(0, folder)
    importlib.invalidate_caches()  # a file written since the folder was last listed
    try:
        yield
    finally:
        sys.path.remove(folder)  # the first one: ours
        if folder not in sys.path:
            sys.path.append(folder)


def _fix(module: str, function: str) -> str:
    top = module.split(".")[0]
    return (f"run from the folder that holds {top}.py, give its path (path/to/{top}.py:{function}), or add its "
            "folder to PYTHONPATH")


def _holds(folder: Path, top: str) -> bool:
    return (folder / f"{top}.py").is_file() or (folder / top).is_dir()


def _import_module(module: str, function: str, folders: list[Path]) -> ModuleType:
    top = module.split(".")[0]
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is None or not (module == e.name or module.startswith(e.name + ".")):
            raise  # the module was found; something it imports is missing
    for folder in folders:
        if _holds(folder, top):
            with _first_on_path(str(folder)):
                found = importlib.import_module(module)
            FOUND_BESIDE[module] = folder
            return found
    where = " or ".join(dict.fromkeys(str(f) for f in folders))
    raise OptimizerError(f"no module {top!r} on Python's path, nor {top}.py in {where}; {_fix(module, function)}")


def _module_name(path: Path) -> str:
    """The file's stem, as `import stem` would name it (so pickles of its classes load in a child, which finds the
    folder on its path), unless that name is another module's: then a name of its own."""
    stem = path.stem
    if stem.isidentifier():
        loaded = sys.modules.get(stem)
        if loaded is not None:
            file = getattr(loaded, "__file__", None)
            if file and Path(file).resolve() == path:
                return stem
        else:
            try:
                spec = importlib.util.find_spec(stem)
            except (ImportError, ValueError):
                spec = None
            if spec is None or (spec.origin and Path(spec.origin).resolve() == path):
                return stem
    return f"_factory_{stem if stem.isidentifier() else 'module'}_{hashlib.sha256(str(path).encode()).hexdigest()[:8]}"


def _import_file(module: str, base_dir: Path | None) -> ModuleType:
    path = file_path(module, base_dir)
    if not path.is_file():
        where = "" if Path(module).expanduser().is_absolute() else \
            f" (a relative path is from {'the recipe' if base_dir else 'the working'} folder)"
        raise OptimizerError(f"no file {path}{where}")
    path = path.resolve()
    name = _module_name(path)
    loaded = sys.modules.get(name)
    if loaded is not None:
        return loaded
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise OptimizerError(f"{path} is not a Python file")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # before it runs: its dataclasses and pickles look it up there
    try:
        with _first_on_path(str(path.parent)):
            spec.loader.exec_module(mod)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return mod


def load_factory(target: str, base_dir: Path | None = None) -> Callable[..., Any]:
    """The target's function. base_dir: the recipe's folder (None for `--model`: the working folder alone).
    OptimizerError "cannot import TARGET: why" when it cannot be imported; errors the user's code raises while it
    is imported are that error, named."""
    module, function = split(target)
    base_dir = base_dir.resolve() if base_dir is not None else None
    folders = [Path.cwd(), *([base_dir] if base_dir is not None else [])]
    try:
        mod = _import_file(module, base_dir) if is_file(module) else _import_module(module, function, folders)
    except OptimizerError as e:
        raise OptimizerError(f"cannot import {target}: {e}") from None
    except (ImportError, SyntaxError) as e:
        raise OptimizerError(f"cannot import {target} ({type(e).__name__}: {e})") from None
    fn = getattr(mod, function, None)
    if not callable(fn):
        where = getattr(mod, "__file__", None) or mod.__name__
        raise OptimizerError(f"cannot import {target}: {where} has no function {function!r}")
    return fn
