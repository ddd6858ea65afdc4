"""A stage's resumable state in its checkpoint directory (kept across requeues and failures, keyed by the
stage's config, removed once the stage succeeded).

Layout: <dir>/step<N>/<group>/ holds each actor group's ranks (`save_checkpoint(dir, tag)`, DeepSpeed's format),
<dir>/step<N>/state.json the driver's own state, and <dir>/latest.json names the latest complete checkpoint.

A checkpoint is code and data that the stage loads (pickled optimizer state included): one in a directory that other
users may write to (its directory, or the run's or the checkpoint root above it) is refused, never loaded.
"""
import contextlib
import json
import os
import shutil
import stat
from pathlib import Path

LATEST = "latest.json"
STATE = "state.json"


def save(ckpt_dir: Path, step: int, groups: dict, state: dict, keep: int) -> None:
    """Save every group's ranks and the driver's `state` (JSON) as step `step`, point latest.json at it, then
    keep only the newest `keep` checkpoints."""
    tag = f"step{step}"
    for name, group in groups.items():
        group.call("save_checkpoint", str(ckpt_dir / tag), name)
    (ckpt_dir / tag / STATE).write_text(json.dumps(state))
    (ckpt_dir / f"{LATEST}.tmp").write_text(json.dumps({"step": step, "tag": tag}))
    os.replace(ckpt_dir / f"{LATEST}.tmp", ckpt_dir / LATEST)  # the checkpoint counts only once this rename happened
    prune(ckpt_dir, keep)
    print(f"[checkpoint] step {step} -> {ckpt_dir / tag}", flush=True)


class UnsafeDirectory(RuntimeError):
    """A directory that other users may write to, where something is about to be loaded from."""


def refuse_world_writable(path: Path, parents: int, what: str) -> None:
    """Raise UnsafeDirectory if `path`, or one of its `parents` nearest parent directories, is writable by other
    users: anyone could then replace what is loaded from it (`what`, for the message). A parent with the sticky
    bit (like /tmp) only lets others add entries, not replace ours, so it passes; `path` itself never does."""
    for level, directory in enumerate([Path(path), *list(Path(path).parents)[:parents]]):
        try:
            mode = directory.stat().st_mode
        except OSError:
            continue  # not there (yet): nothing to load from it
        if mode & stat.S_IWOTH and not (level and mode & stat.S_ISVTX):
            raise UnsafeDirectory(
                f"refusing to load {what} from {path}: {directory} is writable by other users "
                f"(mode {stat.filemode(mode)}), so anyone could have replaced what is loaded from it. "
                f"Check its contents, run `chmod o-w {directory}`, and run again")


def latest(ckpt_dir: Path | None) -> dict | None:
    """{"step", "tag"} of the latest complete checkpoint in ckpt_dir, or None. Refuses (UnsafeDirectory) a
    checkpoint directory that other users may write to, or whose run or checkpoint root directory they may."""
    if ckpt_dir is None or not (ckpt_dir / LATEST).exists():
        return None
    refuse_world_writable(ckpt_dir, 2, "a checkpoint")
    return json.loads((ckpt_dir / LATEST).read_text())


def resume(ckpt_dir: Path | None, groups: dict, name: str) -> tuple[int, dict] | None:
    """Load the latest checkpoint into every group's ranks: (its step, the driver's state), or None if none."""
    found = latest(ckpt_dir)
    if found is None:
        return None
    for group_name, group in groups.items():
        group.call("load_checkpoint", str(ckpt_dir / found["tag"]), group_name)
    state = json.loads((ckpt_dir / found["tag"] / STATE).read_text())
    print(f"[{name}] resumed from checkpoint at step {found['step']}", flush=True)
    return found["step"], state


def prune(ckpt_dir: Path, keep: int) -> None:
    """Remove all but the newest `keep` checkpoints up to the latest one, and any newer one (a save that was cut
    short before its latest.json)."""
    found = latest(ckpt_dir)
    newest = found["step"] if found else -1
    steps = sorted(int(p.name[4:]) for p in ckpt_dir.glob("step*") if p.name[4:].isdigit())
    kept = [s for s in steps if s <= newest][-keep:]
    for step in steps:
        if step not in kept:
            shutil.rmtree(ckpt_dir / f"step{step}", ignore_errors=True)


def remove(ckpt: Path) -> None:
    """Remove a succeeded stage's checkpoints, and checkpoints/<run>/ and checkpoints/ if that left them empty."""
    shutil.rmtree(ckpt, ignore_errors=True)
    remove_if_empty(ckpt)


def remove_if_empty(ckpt: Path) -> None:
    """Remove checkpoints/<run>/<hash>/, checkpoints/<run>/ and checkpoints/ where they are empty."""
    for directory in (ckpt, ckpt.parent, ckpt.parent.parent):
        with contextlib.suppress(OSError):
            directory.rmdir()
