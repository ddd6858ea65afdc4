"""Task rewards: reward functions from Python files, checked, and the VADER sentiment the movie-review task uses.

A reward file defines `reward_fn(prompts, completions, labels) -> one number per completion` (prompts as the model
saw them, completions as text, labels from the dataset's label_key or None). Before any job is queued it is imported,
its signature checked and it is called once on a few of the experiment's prompts (launcher/config.py); each call's
result is checked where it is used.
"""
import importlib.util
import inspect
import math
import traceback
from pathlib import Path


class RewardFileError(ValueError):
    """A reward file that cannot be used, or a reward_fn call that returned something unusable; names the file."""


def is_remote(reward) -> bool:
    """Whether a reward is a service's URL (runtime/remote_reward.py) rather than `model`, `judge` or a reward file."""
    return isinstance(reward, str) and reward.startswith(("http://", "https://"))


def reward_name(reward: str) -> str:
    """A reward's name in metrics and tables (reward_<name>): reward_model for `model`, judge for `judge`, remote for
    a reward service's URL, else the file's name."""
    if reward == "model":
        return "reward_model"
    if reward == "judge":
        return "judge"
    return "remote" if is_remote(reward) else Path(reward).stem


def import_user_file(path: Path, error: type, what: str, kind: str):
    """A user's Python file (a reward or environment file) as a module of its own; `error` naming the file and saying
    `what` a valid one is, where it is missing, not a .py file or fails to import."""
    if not path.exists():
        raise error(f"{path}: no such file (relative paths are taken from the repository root); {what}")
    if path.is_dir():
        raise error(f"{path} is a directory, not a Python file; {what}")
    if path.suffix != ".py":
        raise error(f"{path} is not a Python file (.py); {what}")
    spec = importlib.util.spec_from_file_location(f"alignpipe_{kind}_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        raise error(f"{path} fails to import: {type(err).__name__}: {err}") from None
    return module


def load_reward_fn(path: Path):
    """reward_fn from a Python file, after checking that it takes (prompts, completions, labels)."""
    path = Path(path)
    module = import_user_file(path, RewardFileError,
                              "a reward is `model` or a .py file defining reward_fn(prompts, completions, labels)",
                              "reward")
    reward_fn = getattr(module, "reward_fn", None)
    if not callable(reward_fn):
        raise RewardFileError(f"{path} must define reward_fn(prompts, completions, labels)")
    try:
        inspect.signature(reward_fn).bind([], [], [])
    except TypeError:
        raise RewardFileError(f"{path}: reward_fn{inspect.signature(reward_fn)} cannot be called as "
                              "reward_fn(prompts, completions, labels)") from None
    return reward_fn


def call_reward_fn(reward_fn, path, prompts: list[str], completions: list[str], labels: list) -> list[float]:
    """reward_fn's scores, checked: one finite number per completion."""
    scores = reward_fn(prompts, completions, labels)
    try:
        scores = [float(s) for s in scores]
    except (TypeError, ValueError):
        raise RewardFileError(f"{path}: reward_fn must return one number per completion, got {scores!r:.200}") from None
    if len(scores) != len(completions):
        raise RewardFileError(f"{path}: reward_fn returned {len(scores)} scores for {len(completions)} completions")
    bad = [i for i, s in enumerate(scores) if not math.isfinite(s)]
    if bad:
        raise RewardFileError(f"{path}: reward_fn returned {scores[bad[0]]} for completion {bad[0]} "
                              f"({completions[bad[0]]!r:.100}); every score must be a finite number")
    return scores


# What a reward file's check pairs with the experiment's prompts: short replies of the kinds a policy gives.
MADE_UP_COMPLETIONS = ("42", "Yes.", "I liked this film.", "No")


def check_reward_call(reward_fn, path, prompts: list[str], labels: list, where: str) -> None:
    """Call reward_fn once as the runtime calls it, on `prompts` (with their labels; `where`: where they come from)
    and made-up completions; RewardFileError naming the file and the call if it raises, or returns anything but one
    finite number per completion."""
    completions = [MADE_UP_COMPLETIONS[i % len(MADE_UP_COMPLETIONS)] for i in range(len(prompts))]
    call = f"called on {len(prompts)} prompts of {where} with made-up completions {completions}"
    try:
        call_reward_fn(reward_fn, path, prompts, completions, labels)
    except RewardFileError as err:
        raise RewardFileError(f"{err} ({call})") from None
    except Exception as err:
        raise RewardFileError(f"{path}: reward_fn raised {traceback.format_exception_only(err)[-1].strip()} "
                              f"({call})") from None


def sentiment(texts: list[str]) -> list[float]:
    """VADER compound score in [-1, 1] per text: > 0 reads positive, < 0 negative."""
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer
    analyzer = SentimentIntensityAnalyzer()
    return [analyzer.polarity_scores(text)["compound"] for text in texts]
