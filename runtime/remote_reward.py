"""Remote rewards: a reward service over HTTP, asked in batches, several at once, with retries.

A reward given as an http:// or https:// URL is a service. Each batch of rows is one `POST <url>` with the JSON body
{"query": [prompt + completion, ...], "prompts": [...], "completions": [...], "labels": [...]} (OpenRLHF's remote
reward request, whose query is the text a reward model reads, plus the completions alone for services that score the
reply), and `Authorization: Bearer <token>` where remote_reward.token_env names the variable holding a token. The
answer is {"rewards": [one number per row]} (other keys, such as serve_rm's "scores" and "extra_logs", are ignored) or
a bare JSON list of them. Timeouts, refused or reset connections, HTTP 5xx and 429 are retried after a doubling
backoff; any other HTTP error, or an answer that is not one finite number per row, fails at once.
"""
import http.client
import json
import math
import os
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from runtime.rewards import MADE_UP_COMPLETIONS

EXCERPT = 200  # characters of a service's answer quoted in an error
_AUTH_HINT = " (does remote_reward.token_env name the variable that holds the service's token?)"


class RemoteRewardError(RuntimeError):
    """A reward service that cannot be used: unreachable, refusing the request, or answering something unusable;
    names the URL."""


def _headers(url: str, token_env: str | None) -> dict:
    """The request's headers, with the bearer token read now (a job's environment, not the launcher's, holds it)."""
    headers = {"Content-Type": "application/json"}
    if token_env:
        token = os.environ.get(token_env)
        if not token:
            raise RemoteRewardError(f"reward service {url}: remote_reward.token_env names {token_env}, which is unset "
                                    f"or empty; export the service's token as {token_env}")
        headers["Authorization"] = f"Bearer {token}"
    return headers


def _excerpt(data: bytes | str, headers: dict) -> str:
    """At most EXCERPT characters of what a service sent, with the token blanked (a debugging service may echo it)."""
    text = data.decode("utf-8", "replace") if isinstance(data, bytes) else data
    token = headers.get("Authorization", "").removeprefix("Bearer ")
    return (text.replace(token, "***") if token else text)[:EXCERPT]


def _body(prompts: list[str], completions: list[str], labels: list) -> bytes:
    return json.dumps({"query": [p + c for p, c in zip(prompts, completions)], "prompts": prompts,
                       "completions": completions, "labels": labels}).encode()


def _post(url: str, body: bytes, headers: dict, timeout: float) -> bytes:
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.read()


def _retryable(err: Exception) -> bool:
    """Whether a failed request may succeed if sent again: a busy or restarting service, not a refused request."""
    # Anything below HTTP (a timeout, a refused or reset connection) is a service starting, restarting or overloaded.
    return not isinstance(err, urllib.error.HTTPError) or err.code >= 500 or err.code == 429


def _describe(err: Exception, timeout: float, headers: dict) -> str:
    """A failed request's error in a few words."""
    if isinstance(err, urllib.error.HTTPError):
        try:
            body = err.read()
        except (OSError, http.client.HTTPException):
            body = b""
        text = _excerpt(body, headers)
        return f"HTTP {err.code} {err.reason}" + (f": {text}" if text else "") + \
            (_AUTH_HINT if err.code in (401, 403) else "")
    reason = err.reason if isinstance(err, urllib.error.URLError) else err  # urlopen wraps errors while connecting
    if isinstance(reason, TimeoutError):
        return f"no answer within {timeout} s"
    if isinstance(reason, ConnectionRefusedError):
        return "connection refused"
    return f"{type(reason).__name__}: {reason}"


def _scores(url: str, answer: bytes, rows: int, headers: dict) -> list[float]:
    """The answer's rewards, checked: exactly one finite number per row."""
    try:
        parsed = json.loads(answer)
    except ValueError:
        parsed = None
    scores = parsed.get("rewards") if isinstance(parsed, dict) else parsed
    if not (isinstance(scores, list) and len(scores) == rows
            and all(isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s) for s in scores)):
        raise RemoteRewardError(f"reward service {url} answered {_excerpt(answer, headers)!r} to {rows} rows; it must "
                                'answer {"rewards": [...]} or a JSON list with one finite number per row')
    return [float(s) for s in scores]


class RemoteReward:
    """A reward service called as a reward function: (prompts, completions, labels) -> one number per row.
    `requests` (retries included) and `retries` count what it sent, for the caller's metrics."""

    def __init__(self, url: str, settings: dict):
        self.url = url
        self.batch_size = int(settings["batch_size"])
        self.concurrency = int(settings["concurrency"])
        self.timeout = float(settings["timeout"])
        self.max_retries = int(settings["retries"])
        self.backoff = float(settings["backoff"])
        self.token_env = settings.get("token_env")
        self.requests = 0
        self.retries = 0
        self._count_lock = threading.Lock()  # batches are sent from the pool's threads

    def __call__(self, prompts: list[str], completions: list[str], labels: list) -> list[float]:
        headers = _headers(self.url, self.token_env)
        starts = range(0, len(prompts), self.batch_size)
        if not starts:
            return []
        pool = ThreadPoolExecutor(max_workers=min(self.concurrency, len(starts)))
        try:
            batches = pool.map(lambda i: self._batch(prompts[i:i + self.batch_size], completions[i:i + self.batch_size],
                                                     labels[i:i + self.batch_size], headers), starts)
            return [score for batch in batches for score in batch]
        finally:
            pool.shutdown(cancel_futures=True)  # a failed batch fails the call: send none of those still queued

    def _batch(self, prompts: list[str], completions: list[str], labels: list, headers: dict) -> list[float]:
        body = _body(prompts, completions, labels)
        for k in range(self.max_retries + 1):
            with self._count_lock:
                self.requests += 1
            try:
                return _scores(self.url, _post(self.url, body, headers, self.timeout), len(prompts), headers)
            except (OSError, http.client.HTTPException) as err:
                error = _describe(err, self.timeout, headers)
                if not _retryable(err):
                    raise RemoteRewardError(f"reward service {self.url} refused the request: {error}") from None
            if k == self.max_retries:
                break
            delay = self.backoff * 2 ** k
            print(f"[reward] {self.url}: {error}; retry {k + 1}/{self.max_retries} in {delay:.1f} s", flush=True)
            with self._count_lock:
                self.retries += 1
            time.sleep(delay)
        raise RemoteRewardError(f"reward service {self.url}: no answer after {self.max_retries + 1} tries ({error}); "
                                f"is it up? (remote_reward.timeout = {self.timeout} s, "
                                f"retries = {self.max_retries})")


def check_service(url: str, settings: dict, prompts: list[str], labels: list) -> str | None:
    """Ask the service once, before any job is queued, to score `prompts` (with their labels) paired with made-up
    completions; None if it answered one finite number per row, else the problem as a sentence naming the URL."""
    hint = ("; start the service before the experiment, or set remote_reward.check: false for a service that starts "
            "with the job")
    completions = [MADE_UP_COMPLETIONS[i % len(MADE_UP_COMPLETIONS)] for i in range(len(prompts))]
    timeout = min(float(settings["timeout"]), 10.0)  # the check must not hold up the launcher for long
    try:
        headers = _headers(url, settings.get("token_env"))
    except RemoteRewardError as err:
        return str(err)
    try:
        _scores(url, _post(url, _body(prompts, completions, labels), headers, timeout), len(prompts), headers)
    except RemoteRewardError as err:
        return f"{err}{hint}"
    except (OSError, http.client.HTTPException) as err:
        error = _describe(err, timeout, headers)
        if error == "connection refused":
            return f"nothing answers at {url} (connection refused){hint}"
        return f"reward service {url} did not score {len(prompts)} rows: {error}{hint}"
    return None
