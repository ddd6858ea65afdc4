"""What the stages run on, inside their jobs: models, data, losses, advantages, LoRA, the DeepSpeed rank, Ray actor
groups, the trainer loop, checkpoints, vLLM rollouts, tracking, progress lines, the Ray bring-up and the job
runner itself. One module per job; see the layout table in docs/development.md.

Importing this package also leaves out two optional imports that cost each process seconds of CPU at its start, for
features no stage uses (`UnusedOptionalImports`)."""
import contextlib
import importlib.machinery
import sys


@contextlib.contextmanager
def reads_as_absent(library: str):
    """Meanwhile `import library` raises ImportError and its spec is None, as if it were not installed."""
    sys.modules[library] = None
    try:
        yield
    finally:
        del sys.modules[library]


class UnusedOptionalImports:
    """MLflow in DeepSpeed's autotuner (2.3 s of CPU in each trainer rank's process, which tracks nothing: the
    stage's driver does) and scikit-learn in transformers' assisted generation (installed for MLflow; 2.4 s in each
    process that loads a model or starts vLLM): the module that asks for the library finds it absent, as both allow
    for; any other import of it works as usual (tests/test_devices.py)."""

    def find_spec(self, name, path=None, target=None):
        if name == "deepspeed.autotuning.autotuner" and "mlflow" not in sys.modules:
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is not None:
                load = spec.loader.exec_module

                def exec_module(module):
                    with reads_as_absent("mlflow"):  # (its `import mlflow` is in a try)
                        load(module)
                spec.loader.exec_module = exec_module
            return spec
        if name == "transformers.generation.candidate_generator" and "sklearn" not in sys.modules:
            check = getattr(sys.modules.get("transformers.utils.import_utils"), "is_sklearn_available", None)
            if check is not None:
                with reads_as_absent("sklearn"):
                    check()  # cached for the process: the module then leaves scikit-learn alone
        return None


if not any(isinstance(finder, UnusedOptionalImports) for finder in sys.meta_path):
    sys.meta_path.insert(0, UnusedOptionalImports())
