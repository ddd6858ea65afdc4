"""A stage's code hash: the part of its cache key that says which code produced its output.

Snakemake's code trigger sees only a rule's own text, not the modules behind it, so each rule's params carry
this hash. It covers exactly the code that can change a stage's output: the stage's module, every project
module it reaches through imports (stages/, runtime/, reports/), and the in-job runner (runtime/job.py, which
seeds, builds the config and publishes the output). It leaves out what only decides where and how a job runs
or is watched: submission, Slurm states, resource checks, config validation (launcher/), and the runner's own
imports (the Ray bring-up, MLflow tracking). Files are hashed as their parsed syntax tree without docstrings,
so editing a comment or a docstring reruns nothing. (A new Python version may parse differently: it then
reruns every stage, as a new interpreter may well change results.)
"""
import ast
import functools
import hashlib
from pathlib import Path

from launcher.config import REPO_ROOT

HASHED_PACKAGES = ("stages", "runtime", "reports")
JOB_RUNNER = REPO_ROOT / "runtime" / "job.py"


def _imported_names(path: Path, tree: ast.Module) -> list[str]:
    """The dotted names the module at `path` imports (relative imports resolved within its package)."""
    names = []
    for node in _statements(tree.body):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import inside the same package
                base = f"{path.parent.name}.{base}" if base else path.parent.name
            names += [base] + [f"{base}.{a.name}" for a in node.names]
    return names


def _project_modules(names) -> set[Path]:
    """The files of the project modules (of HASHED_PACKAGES) among dotted `names`."""
    found = set()
    for name in names:
        parts = name.split(".")
        if parts[0] not in HASHED_PACKAGES:
            continue
        candidate = REPO_ROOT.joinpath(*parts)
        for file in (candidate.with_suffix(".py"), candidate / "__init__.py"):
            if file.is_file():
                found.add(file)
    return found


def _statements(nodes):
    """Every statement in `nodes` and in the blocks nested in them, at any depth. Imports and definitions are
    statements, and statements nest only in these fields: walking them alone skips the expressions, which ast.walk
    visits too (the nine stages' hashes: 0.49 s instead of 0.69 in each Snakemake run, on 2 idle cores)."""
    for node in nodes:
        if isinstance(node, ast.stmt):
            yield node
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):  # (handlers, cases: blocks, not statements)
            yield from _statements(getattr(node, field, ()))


def _without_docstrings(tree: ast.Module) -> ast.Module:
    for node in (tree, *_statements(tree.body)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            is_docstring = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                and isinstance(first.value.value, str)
            if is_docstring:
                node.body = node.body[1:] or [ast.Pass()]
    return tree


@functools.lru_cache(maxsize=None)
def _parsed(path: Path, text: str) -> tuple[tuple[str, ...], str]:
    """The names a module's text imports and its syntax tree without docstrings: parsed once per process (a DAG's
    stages share most of their modules; parsing them for each stage took half of a dry run)."""
    tree = ast.parse(text, filename=str(path))
    return tuple(_imported_names(path, tree)), ast.dump(_without_docstrings(tree))


def stage_code_hash(stage: str) -> str:
    """Hash of stages/<stage>.py, the project modules it reaches through imports, and the in-job runner."""
    modules: dict[Path, str] = {}
    todo = [REPO_ROOT / "stages" / f"{stage}.py"]
    while todo:
        file = todo.pop()
        if file in modules:
            continue
        names, modules[file] = _parsed(file, file.read_text())
        todo.extend(_project_modules(names) - modules.keys())
    if JOB_RUNNER not in modules:  # (its own imports left out: the Ray bring-up, MLflow tracking)
        modules[JOB_RUNNER] = _parsed(JOB_RUNNER, JOB_RUNNER.read_text())[1]
    digest = hashlib.sha256()
    for file in sorted(modules):
        digest.update(str(file.relative_to(REPO_ROOT)).encode() + b"\0" + modules[file].encode() + b"\0")
    return digest.hexdigest()[:16]
