"""Multi-turn episodes against a researcher's environment: loading its file, running its calls with timeouts, and
the token bookkeeping of an episode (token in, token out).

An environment file defines `class Environment`, one instance per episode:

    reset(prompt, label, seed) -> the first messages ([{"role", "content"}, ...]), a str (one user message), or None
                                  (the preprocessed prompt as it is); `prompt` is the task's text before any template,
                                  `seed` is shared by the n episodes of a prompt's group
    step(reply) -> (messages, reward, done) or (messages, reward, done, info): `reply.text` the model's reply,
                   `reply.tool_calls` the calls parsed from it; messages a list (user or tool role) or a str;
                   info["success"] counts in the success rate
    close()                       optional
    tools                         optional: function schemas, rendered by chat templates that take tools

Methods may be async. The episode's trained ids are the prompt, then each reply exactly as sampled, then the tokens
the chat template puts after it (the boundary, e.g. ChatML's "\\n" after <|im_end|>) and the environment's messages
as the template renders them behind a fixed prefix; only the replies have loss mask 1. Decoding replies and encoding
the conversation again would not give the sampled tokens back (BPE is not a bijection): the drift monitor counts the
episodes where it would not.
"""
from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import multiprocessing
import queue
import random
import re
import statistics
import threading
import time
import traceback
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

from runtime.models import end_of_turn, model_positions
from runtime.progress import beat
from runtime.rewards import import_user_file


class EnvironmentFileError(ValueError):
    """An environment file that cannot be used; names the file."""


class EnvironmentTimeout(RuntimeError):
    pass


def load_environment(path) -> type:
    """The Environment class of a Python file, after checking reset(prompt, label, seed) and step(reply)."""
    path = Path(path)
    what = "an environment is a .py file defining class Environment with reset(prompt, label, seed) and step(reply)"
    module = import_user_file(path, EnvironmentFileError, what, "environment")
    cls = getattr(module, "Environment", None)
    if not inspect.isclass(cls):
        raise EnvironmentFileError(f"{path} must define class Environment; {what}")
    for method, params in (("reset", ("prompt", "label", "seed")), ("step", ("reply",))):
        fn = getattr(cls, method, None)
        if not callable(fn):
            raise EnvironmentFileError(f"{path}: Environment has no method {method}; {what}")
        try:
            inspect.signature(fn).bind(None, *params)
        except TypeError:
            raise EnvironmentFileError(f"{path}: Environment.{method}{inspect.signature(fn)} cannot be called as "
                                       f"{method}({', '.join(params)}); {what}") from None
    return cls


@dataclasses.dataclass
class Reply:
    """What step() receives: the reply's text (without the end of turn) and the tool calls parsed from it."""
    text: str
    tool_calls: list[dict]


def parse_tool_calls(text: str) -> list[dict]:
    """Tool calls in the model's own format, each {"name", "arguments"}: Hermes/Qwen's <tool_call>{json}</tool_call>,
    Mistral's [TOOL_CALLS][{json}, ...], or a reply that is one JSON object with a name (Llama 3.1)."""
    found = re.findall(r"<tool_call>\s*(.*?)\s*</tool_call>", text, re.S)
    if not found and "[TOOL_CALLS]" in text:
        found = [text.split("[TOOL_CALLS]", 1)[1].strip()]
    if not found and text.strip().startswith("{"):
        found = [text.strip()]
    calls = []
    for raw in found:
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            continue
        for call in value if isinstance(value, list) else [value]:
            if isinstance(call, dict) and isinstance(call.get("name"), str):
                arguments = call.get("arguments", call.get("parameters", {}))
                if isinstance(arguments, str):
                    try:
                        arguments = json.loads(arguments)
                    except json.JSONDecodeError:
                        pass
                calls.append({"name": call["name"], "arguments": arguments})
    return calls


def as_messages(value, role: str = "user") -> list[dict]:
    """A str as one message of `role`; a list of messages as it is."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in value):
        return value
    raise TypeError(f"expected a str or a list of {{'role', 'content'}} messages, got {value!r:.200}")


# --- Running an episode's calls: its own thread (or child process), a deadline, a bound on calls at once ---

def serve_calls(make_env, requests: queue.SimpleQueue) -> None:
    """An episode's environment, served on this thread with an event loop of its own (async methods keep one loop
    for the episode). Each request (method, args, future) gets its result or exception; (None, ...) ends it."""
    loop, env = asyncio.new_event_loop(), None
    while True:
        method, args, future = requests.get()
        if method is None:
            break
        try:
            env = env or make_env()
            result = getattr(env, method)(*args)
            if inspect.isawaitable(result):
                result = loop.run_until_complete(result)
            future.set_result(result)
        except BaseException as err:  # (the caller decides what an error does)
            future.set_exception(err)
    loop.close()


def child_main(path: str, conn) -> None:
    """An episode's environment in a child process (isolation: process): calls from the pipe, answers back."""
    requests, env_cls = queue.SimpleQueue(), load_environment(path)
    threading.Thread(target=serve_calls, args=(env_cls, requests), daemon=True).start()
    while True:
        method, args = conn.recv()
        future = Future()
        requests.put((method, args, future))
        try:
            conn.send(("ok", future.result()))
        except BaseException as err:
            conn.send(("error", f"{type(err).__name__}: {err}"))


class ChildEnvironment:
    """An environment in a killable child process (forkserver: no copy of this process's threads or engines)."""

    def __init__(self, path: str):
        context = multiprocessing.get_context("forkserver")
        self.conn, child = context.Pipe()
        self.process = context.Process(target=child_main, args=(path, child), daemon=True)
        self.process.start()

    def __getattr__(self, method):
        def call(*args):
            self.conn.send((method, args))
            kind, value = self.conn.recv()
            if kind == "error":
                raise RuntimeError(value)
            return value
        return call

    def kill(self) -> None:
        self.process.kill()


class EpisodeEnvironment:
    """One episode's environment on a daemon thread of its own: `call` waits `timeout` seconds at most (from when a
    slot of `slots`, the concurrency bound, is free), then gives the call up (EnvironmentTimeout). A hung call keeps
    only its own daemon thread (or its killed child process), never the stage: a ThreadPoolExecutor's threads would be
    joined when the process exits."""

    def __init__(self, env_cls, path: str, isolation: str, slots: threading.Semaphore, timeout: float):
        self.child = None
        if isolation == "process":
            make = lambda: self.child
            self.child = ChildEnvironment(path)
        else:
            make = env_cls
        self.requests, self.slots, self.timeout = queue.SimpleQueue(), slots, timeout
        threading.Thread(target=serve_calls, args=(make, self.requests), daemon=True, name="environment").start()

    def call(self, method: str, *args):
        with self.slots:
            future = Future()
            self.requests.put((method, args, future))
            try:
                return future.result(timeout=self.timeout)
            except FutureTimeout:
                self.abandon()
                raise EnvironmentTimeout(f"{method} did not return within {self.timeout:g} s") from None

    def abandon(self) -> None:
        if self.child:
            self.child.kill()

    def stop(self) -> None:
        self.requests.put((None, (), None))
        if self.child:  # (its close, if any, was called)
            self.child.kill()
            self.child.process.join()


def call_all(calls: list) -> list:
    """Run `calls` (functions of no arguments) at once on daemon threads; each one's result or exception, in order."""
    results: list = [None] * len(calls)

    def run(i):
        try:
            results[i] = calls[i]()
        except BaseException as err:
            results[i] = err
    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()  # (each call ends by its own deadline)
    return results


# --- Token in, token out ---

MARK = "\x00REPLY\x00"


class ChatFormat:
    """The chat template's tokens around a conversation's turns, for one tokenizer. The tokens after a reply are
    found by rendering the environment's messages behind a fixed prefix ([user, assistant]) and taking the
    difference; a template whose render of the prefix changes once more messages follow is refused."""

    def __init__(self, tokenizer, tools: list | None, source: str):
        if not tokenizer.chat_template:
            raise ValueError(f"{source}: the model has no chat template; multi-turn episodes need one to render the "
                             "environment's messages (give a chat model, or a tokenizer_config.json with a chat_template)")
        self.tokenizer, self.tools = tokenizer, tools or None
        self.prefix = [{"role": "user", "content": "?"}, {"role": "assistant", "content": MARK}]
        text = self.render(self.prefix, False)
        eot = end_of_turn(tokenizer)
        self.eot_ids = self.encode(eot)
        after = text[text.rindex(MARK) + len(MARK):]
        reply_end = text[:text.rindex(MARK) + len(MARK) + (len(eot) if after.startswith(eot) else 0)]
        self.prefix_ids = self.encode(text)
        # what the template writes after the end of turn (ChatML: "\n"), which generation stops before
        self.boundary_ids = self.difference(self.encode(reply_end), self.prefix_ids, "the end of a reply")

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def render(self, messages: list[dict], generation_prompt: bool, tools: list | None = None) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    @staticmethod
    def difference(prefix: list[int], full: list[int], what: str) -> list[int]:
        if full[:len(prefix)] != prefix:
            raise ValueError(f"the chat template renders {what} differently once more messages follow (its tokens are "
                             "not a prefix of the longer conversation's): the trained tokens would not be the "
                             "conversation's")
        return full[len(prefix):]

    def first(self, messages: list[dict]) -> list[int]:
        """The ids of the episode's first messages with the assistant's generation prompt (the tools rendered)."""
        return self.encode(self.render(messages, True, self.tools))

    def continuation(self, messages: list[dict]) -> list[int]:
        """The ids the template adds after a reply's boundary for `messages`, up to the next generation prompt."""
        full = self.encode(self.render(self.prefix + messages, True))
        return self.difference(self.prefix_ids, full, "a conversation")


# --- Episodes ---

PROMPT_ROOM = 512  # tokens an environment's first messages (a system message, tools) may add to the longest prompt


def context_length(longest_prompt: int, max_new_tokens: int, settings: dict | None, model_dir) -> int:
    """The engines' max_model_len: the longest prompt and a reply, or an episode with its first messages (at most
    the model's positions: an episode whose first messages leave too little room ends with an error)."""
    if settings is None:
        return longest_prompt + max_new_tokens + 8
    wanted = longest_prompt + PROMPT_ROOM + settings["max_episode_tokens"]
    return min(wanted, model_positions(model_dir) or wanted)


@dataclasses.dataclass
class Episode:
    prompt_ids: list[int]
    ids: list[int] = dataclasses.field(default_factory=list)  # everything after the prompt
    mask: list[float] = dataclasses.field(default_factory=list)  # 1 on the replies' tokens
    logprobs: list[float] = dataclasses.field(default_factory=list)  # vLLM's, 0 off the mask
    rewards: list[float] = dataclasses.field(default_factory=list)  # each step's reward at its reply's last token
    messages: list[dict] | None = None  # the conversation, where reset gave its first messages
    replies: list[str] = dataclasses.field(default_factory=list)
    env: EpisodeEnvironment | None = None
    done: bool = False
    truncated: bool = False  # ended by the token budget
    error: str | None = None
    timeout: bool = False
    success: bool = False
    env_seconds: float = 0.0
    env_tokens: int = 0  # the environment's messages (and the boundaries before them) after the prompt

    def add(self, ids: list[int], mask: float, logprobs: list[float] | None = None) -> None:
        self.ids += ids
        self.mask += [mask] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.rewards += [0.0] * len(ids)

    def last_reply_token(self) -> int:
        return max((i for i, m in enumerate(self.mask) if m), default=0)

    def stats(self, drift: bool) -> dict:
        return {"turns": len(self.replies), "env_tokens": self.env_tokens, "truncated": self.truncated,
                "error": self.error, "timeout": self.timeout, "success": self.success,
                "env_seconds": self.env_seconds, "drift": drift, "reward": sum(self.rewards)}


def summarise(stats: list[dict]) -> dict:
    """Means over episodes (their Episode.stats): turns, env_tokens, env_seconds, reward, and the shares truncated,
    successful, with an error, a timeout, drift."""
    mean = lambda value: statistics.fmean(float(value(s)) for s in stats)
    return {key: mean(lambda s, key=key: s[key]) for key in ("turns", "env_tokens", "env_seconds", "reward")} | {
        "truncated": mean(lambda s: s["truncated"]), "success": mean(lambda s: s["success"]),
        "errors": mean(lambda s: s["error"] is not None), "timeouts": mean(lambda s: s["timeout"]),
        "drift": mean(lambda s: s["drift"])}


def group_seed(seed: int, group: int) -> int:
    """The environment's seed of a prompt's group: its n episodes play the same task."""
    return random.Random(f"{seed}/environment/{group}").randrange(2**31)


def turn_seed(seed: int, episode: int, turn: int) -> int:
    """The sampling seed of one (episode, turn) of a step whose sampling seed is `seed`: a resumed run replays it."""
    return random.Random(f"{seed}/episode {episode}/turn {turn}").randrange(2**31)


class EpisodeRunner:
    """Runs the episodes of a rollout: every live episode's turn generated at once, their environments stepped at
    once. `settings` is the experiment's environment block (the schema's)."""

    def __init__(self, settings: dict, path, tokenizer, max_len: int):
        self.settings, self.path, self.max_len = settings, str(path), max_len
        self.env_cls = load_environment(path)
        self.format = ChatFormat(tokenizer, getattr(self.env_cls, "tools", None), str(path))
        self.tokenizer = tokenizer
        self.slots = threading.Semaphore(settings["concurrency"])
        self.stopping = threading.Event()  # set when the stage ends early: no turn starts after it

    def timed(self, episode: Episode, method: str, *args):
        """episode.env's `method`: its result; None after a timeout (the episode ends); the exception it raised (the
        episode ends unless on_error is observe), recorded as the episode's error."""
        t0 = time.perf_counter()
        try:
            return episode.env.call(method, *args)
        except EnvironmentTimeout as err:
            episode.timeout, episode.error, episode.done = True, f"{method}: {err}", True
        except Exception as err:
            episode.error = f"{method} raised {traceback.format_exception_only(err)[-1].strip()}"
            if method == "reset" or self.settings["on_error"] == "end":
                episode.done = True
            return err
        finally:
            episode.env_seconds += time.perf_counter() - t0
        return None

    def cut(self, messages: list[dict]) -> list[dict]:
        """Each message's content cut to max_env_tokens tokens."""
        limit = self.settings["max_env_tokens"]
        out = []
        for message in messages:
            ids = self.format.encode(str(message["content"]))
            content = self.tokenizer.decode(ids[:limit]) if len(ids) > limit else str(message["content"])
            out.append(message | {"content": content})
        return out

    def run(self, generate, prompts: list[dict], n: int, seed: int, max_new_tokens: int) -> list[tuple[Episode, dict]]:
        """n episodes per prompt (rows with prompt_ids, prompt text, input and label); `generate(contexts, seeds,
        max_tokens)` samples one reply per context. Each episode with its stats, in prompt order."""
        settings = self.settings
        episodes = [Episode(prompt["prompt_ids"]) for prompt in prompts for _ in range(n)]
        for i, episode in enumerate(episodes):
            episode.env = EpisodeEnvironment(self.env_cls, self.path, settings["isolation"], self.slots,
                                             settings["timeout"])
        starts = call_all([lambda e=e, p=prompts[i // n], i=i: self.timed(e, "reset", p.get("input", p["prompt"]),
                                                                            p.get("label"), group_seed(seed, i // n))
                           for i, e in enumerate(episodes)])
        for episode, first in zip(episodes, starts):
            if episode.done or first is None:
                continue
            try:
                episode.messages = as_messages(first)  # (the task as the environment sets it: not cut)
                episode.prompt_ids = self.format.first(episode.messages)
            except (TypeError, KeyError) as err:
                episode.error, episode.done = f"reset returned what is not messages: {err}", True
        for episode in episodes:
            if len(episode.prompt_ids) + settings["max_episode_tokens"] > self.max_len:
                episode.error, episode.done = (f"the first messages are {len(episode.prompt_ids)} tokens: with "
                                               f"max_episode_tokens they exceed the engine's {self.max_len}"), True
        budget = settings["max_episode_tokens"]
        for turn in range(settings["max_turns"]):
            live = [i for i, e in enumerate(episodes) if not e.done]
            if not live:
                break
            if self.stopping.is_set():
                raise RuntimeError("the stage is ending: its episodes stop")
            room = [budget - len(episodes[i].ids) for i in live]
            samples = generate([episodes[i].prompt_ids + episodes[i].ids for i in live],
                               [turn_seed(seed, i, turn) for i in live], [min(max_new_tokens, r) for r in room])
            stepping = []
            for i, sample, left in zip(live, samples, room):
                episode = episodes[i]
                reply = list(sample["token_ids"]) or self.format.eot_ids
                episode.add(reply, 1.0, (sample["logprobs"] or [0.0] * len(reply))[:len(reply)])
                ended = reply[-len(self.format.eot_ids):] == self.format.eot_ids
                body = reply[:-len(self.format.eot_ids)] if ended else reply
                text = self.tokenizer.decode(body, skip_special_tokens=True)
                episode.replies.append(text)
                if episode.messages is not None:
                    episode.messages.append({"role": "assistant", "content": text})
                if not ended and len(reply) >= left:  # the episode's budget ran out inside the reply
                    episode.truncated = episode.done = True
                    continue
                if not ended:  # cut at max_new_tokens: the end of turn the template would write, not trained on
                    episode.add(self.format.eot_ids, 0.0)
                call = Reply(text, parse_tool_calls(self.tokenizer.decode(body, skip_special_tokens=False)))
                stepping.append((episode, call))
            # (the stall watch names this if the stage stalls here: an environment hung past every timeout)
            beat(f"episodes: turn {turn + 1} generated, waiting on {len(stepping)} environment steps")
            results = call_all([lambda e=e, c=c: self.timed(e, "step", c) for e, c in stepping])
            for (episode, _), result in zip(stepping, results):
                self.apply(episode, result, turn)
        if hasattr(self.env_cls, "close"):
            call_all([lambda e=e: self.timed(e, "close") for e in episodes if not e.timeout])
        for episode in episodes:
            episode.env.stop()
            episode.env = None
        return [(e, e.stats(self.drifts(e))) for e in episodes]

    def apply(self, episode: Episode, result, turn: int) -> None:
        """A step's result: the reward at the reply's last token, then the next messages (unless the episode ends)."""
        if episode.done:  # a timeout, or an error that ends it
            return
        if isinstance(result, Exception):  # on_error: observe
            messages = [{"role": "user", "content": f"The environment raised an error: {episode.error}"}]
        else:
            try:
                messages, reward, done, *info = result
                messages = as_messages(messages or [], "user")
                episode.rewards[episode.last_reply_token()] += float(reward)
            except (TypeError, ValueError) as err:
                episode.error, episode.done = f"step returned {result!r:.200}, not (messages, reward, done[, info]): " \
                                              f"{err}", True
                return
            if info and isinstance(info[0], dict) and info[0].get("success"):
                episode.success = True
            if done:
                episode.done = True
                return
        if turn + 1 == self.settings["max_turns"]:
            episode.done = True
            return
        messages = self.cut(messages)
        following = self.format.boundary_ids + self.format.continuation(messages)
        if len(episode.ids) + len(following) >= self.settings["max_episode_tokens"]:  # no room for a reply after it
            episode.truncated = episode.done = True
            return
        episode.add(following, 0.0)
        episode.env_tokens += len(following)
        if episode.messages is not None:
            episode.messages += messages

    def drifts(self, episode: Episode) -> bool:
        """Would re-rendering the conversation (chat template, then tokenizer) give other ids than those trained?"""
        trained = episode.prompt_ids + episode.ids
        text = self.tokenizer.decode(trained, skip_special_tokens=False)
        if self.format.encode(text) != trained:
            return True
        if episode.messages is None:
            return False
        rendered = self.format.render(episode.messages, False, self.format.tools)
        return not rendered.startswith(text)
