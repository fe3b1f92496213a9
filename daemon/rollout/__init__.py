"""Deprecated import paths: the rollout engine moved out of the daemon into `corral.rollout`.

`corral.daemon.rollout.X` still imports, for one release, as a forwarding module (same classes and
functions, a DeprecationWarning naming the new path):

- `corral.daemon.rollout.<module>`                 -> `corral.rollout.<module>`
- `corral.daemon.rollout.llm.{client,routing,sglang,vllm}` -> `corral.rollout.llm.*`
- `corral.daemon.rollout.llm.reference_server`     -> `corral.rollout.reference.server`
- `corral.daemon.rollout.llm.{policies,replay,tiny,tiny_model}` -> `corral.rollout.reference.*`
- `corral.daemon.rollout.llm.pool`                 -> `corral.daemon.llm_pool`
- `corral.daemon.rollout.runtime`                  -> `corral.daemon.rollout_runtime`
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings

_PREFIX = __name__ + "."
_MOVED = {
    "llm.reference_server": "corral.rollout.reference.server",
    "llm.policies": "corral.rollout.reference.policies",
    "llm.replay": "corral.rollout.reference.replay",
    "llm.tiny": "corral.rollout.reference.tiny",
    "llm.tiny_model": "corral.rollout.reference.tiny_model",
    "llm.pool": "corral.daemon.llm_pool",
    "runtime": "corral.daemon.rollout_runtime",
}


def new_name(old: str) -> str:
    """The import path that replaces `old` (a name under corral.daemon.rollout)."""
    rest = old.removeprefix(_PREFIX)
    return _MOVED.get(rest, f"corral.rollout.{rest}")


class _ForwardingFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers imports under the old package with a module that forwards every attribute to the
    module at the new path, so that classes keep their identity (isinstance, except clauses), and
    `python -m` of an old module path with the new module's code. Names that have no new module
    are not found, as before."""

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(_PREFIX):
            return None
        moved = importlib.util.find_spec(new_name(fullname))
        if moved is None:
            return None
        return importlib.util.spec_from_loader(fullname, self, is_package=moved.submodule_search_locations is not None)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        target = importlib.import_module(_warn_moved(spec.name))
        module = types.ModuleType(spec.name, target.__doc__)
        module.__getattr__ = lambda attribute: getattr(target, attribute)  # type: ignore[method-assign]
        module.__dir__ = lambda: dir(target)  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass

    def get_code(self, fullname: str) -> types.CodeType | None:
        """The new module's code, for `python -m <old path>`."""
        target = importlib.util.find_spec(_warn_moved(fullname))
        loader = target.loader if target else None
        return loader.get_code(target.name) if isinstance(loader, importlib.abc.InspectLoader) and target else None


def _warn_moved(old: str) -> str:
    """Warns that `old` moved; returns the new name."""
    moved = new_name(old)
    warnings.warn(
        f"{old} moved to {moved}; the old path goes away in the next release", DeprecationWarning, stacklevel=3
    )
    return moved


if not any(isinstance(finder, _ForwardingFinder) for finder in sys.meta_path):
    sys.meta_path.insert(0, _ForwardingFinder())
