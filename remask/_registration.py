"""Registration of remask's model families with transformers' Auto classes, without importing
transformers (or torch) at `import remask`.

`remask.models` registers its config classes with `AutoConfig` when it is imported, and that costs
what `transformers.PreTrainedConfig` costs (torch: about two seconds). transformers looks every
`model_type` up through `transformers.models.auto.configuration_auto` (`AutoConfig` /
`AutoModel*.from_pretrained`, `from_config`, `CONFIG_MAPPING`), so remask only has to be
registered by the time that module is usable: `install()` imports `remask.models` at once if it
already is, and otherwise right after the import of transformers that brings it in.

"Right after" is the end of the outermost import of a `transformers` module, in the importing
thread, during which `configuration_auto` was loaded: not at the end of `configuration_auto`
itself, because that can be imported half-way through another transformers module (e.g.
`modeling_auto`) that `remask.models` needs whole (Qwen2's configuration, which Fast-dLLM v2's
subclasses, reads `modeling_auto` when its class is defined). To see those ends, a finder at the
front of `sys.meta_path` hands every `transformers` module to the finder that would have loaded it
and wraps that loader to count the depth of nested transformers imports; it removes itself when
remask is registered. Nothing else is changed: each module keeps its own loader once executed.
(Plain classes, not `importlib.abc`'s, whose import costs more than the rest of `import remask`.)
"""
from __future__ import annotations

import importlib
import sys
import threading
from typing import Any

TARGET = "transformers.models.auto.configuration_auto"

_local = threading.local()   # .depth: transformers modules being executed in this thread
_lock = threading.Lock()


def _register() -> None:
    importlib.import_module("remask.models")   # registers the config classes (remask/models/__init__.py)


def _auto_config_loaded() -> bool:
    return getattr(sys.modules.get(TARGET), "AutoConfig", None) is not None


class _Loader:
    """The loader that would have run a transformers module, counting nested transformers imports;
    at the end of an outermost one that left `configuration_auto` loaded, remask is registered."""

    def __init__(self, loader: Any, finder: "_Finder") -> None:
        self._loader = loader
        self._finder = finder

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        depth = getattr(_local, "depth", 0)
        _local.depth = depth + 1
        try:
            self._loader.exec_module(module)
        finally:
            _local.depth = depth
            module.__loader__ = self._loader   # the module keeps the loader it would have had
            if getattr(module, "__spec__", None) is not None and module.__spec__.loader is self:
                module.__spec__.loader = self._loader
        if depth == 0 and _auto_config_loaded():
            self._finder.done()

    def __getattr__(self, name: str) -> Any:   # get_source, get_filename, is_package, ...: the real loader's
        if name == "_loader":   # not set yet (an instance made without __init__, e.g. by copy)
            raise AttributeError(name)
        return getattr(self._loader, name)


class _Finder:
    """Finds `transformers` modules through the other finders and wraps their loaders."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != "transformers" and not fullname.startswith("transformers."):
            return None
        for finder in list(sys.meta_path):
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _Loader(spec.loader, self)
        return spec

    def done(self) -> None:
        """Remove this finder and register remask (once)."""
        with _lock:
            if self not in sys.meta_path:
                return
            sys.meta_path.remove(self)
        _register()


def install() -> None:
    """Register remask's families with transformers now if its Auto classes are already imported,
    else as soon as an import of transformers brings them in."""
    if _auto_config_loaded():
        _register()
    elif not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
