"""A stand-in `ray` package for the GPU check (tests/gpu/check_training.py) only: never used by the pipeline.

The worker classes live in modules that import Ray at module level (runtime/trainer.py, actor_group.py, rollout.py,
rl_actors.py, weight_sync.py, stages/rl.py), but the check calls the workers directly in one process and needs no
Ray; the GPU machine it is written for has none. `install()` makes those imports succeed there:

- where `import ray` works, nothing changes (the real Ray is used; the check still never calls it);
- where it fails, or always with ALIGNPIPE_GPU_CHECK_FAKE_RAY=1 (which hides an installed Ray: CI runs the check that
  way, so a Ray call sneaking into the check's path fails there), `ray` and every `ray.*` module
  (ray.util, ray.util.placement_group, ray.util.scheduling_strategies, ray.exceptions, ...) import as placeholder
  modules. Any name taken from them (`ray.get`, `from ray.util.placement_group import placement_group`) is a
  placeholder too, so the imports work; using one (calling it, or reading an attribute of it) raises
  RayUnavailable("Ray is not available in the GPU check: ray.get was called") and is recorded in `USED`, which the
  check reports and requires to be empty.
"""
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types

FORCE_ENV = "ALIGNPIPE_GPU_CHECK_FAKE_RAY"
USED: list[str] = []  # every placeholder use, in order (the check requires none)


class RayUnavailable(RuntimeError):
    pass


def _fail(name: str, how: str):
    USED.append(name)
    raise RayUnavailable(f"Ray is not available in the GPU check: {name} was {how}")


class _Placeholder:
    """A name from the placeholder `ray` (a function, class or constant); any use of it raises."""
    __slots__ = ("_name",)

    def __init__(self, name: str):
        object.__setattr__(self, "_name", name)

    def __getattr__(self, attr):
        if attr.startswith("__") and attr.endswith("__"):  # introspection (hasattr, copy, inspect) finds nothing
            raise AttributeError(attr)
        _fail(f"{self._name}.{attr}", "used")

    def __setattr__(self, attr, value):
        _fail(f"{self._name}.{attr}", "set")

    def __call__(self, *args, **kwargs):
        _fail(self._name, "called")

    def __bool__(self):
        _fail(self._name, "tested")

    def __iter__(self):
        _fail(self._name, "iterated")

    def __getitem__(self, key):
        _fail(self._name, "indexed")

    def __enter__(self):
        _fail(self._name, "entered")

    def __exit__(self, *exc):
        return False

    def __repr__(self):
        return f"<placeholder {self._name}: Ray is not available in the GPU check>"


class _PlaceholderModule(types.ModuleType):
    """`ray` or `ray.<sub>`: a package (so any submodule imports) whose every name is a placeholder."""

    def __getattr__(self, attr):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        sub = sys.modules.get(f"{self.__name__}.{attr}")
        return sub if sub is not None else _Placeholder(f"{self.__name__}.{attr}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "ray" or fullname.startswith("ray."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return _PlaceholderModule(spec.name)

    def exec_module(self, module):
        module.__path__ = []
        module.__doc__ = "placeholder: Ray is not available in the GPU check (tests/gpu/ray_placeholder.py)"
        module.__alignpipe_placeholder__ = True


def is_placeholder(module) -> bool:
    return getattr(module, "__alignpipe_placeholder__", False)


def install() -> str:
    """Make `import ray` work for the check; returns what `ray` is: "real", or why it is the placeholder."""
    forced = os.environ.get(FORCE_ENV) == "1"
    if not forced:
        if importlib.util.find_spec("ray") is not None:
            return "real"
    loaded = [name for name in sys.modules if name == "ray" or name.startswith("ray.")]
    if any(not is_placeholder(sys.modules[name]) for name in loaded):
        raise RuntimeError(f"{FORCE_ENV}=1, but the real ray is already imported ({loaded[:3]}): install the "
                           "placeholder before anything imports ray")
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    return f"placeholder ({FORCE_ENV}=1 hides the installed ray)" if forced else "placeholder (ray is not installed)"
