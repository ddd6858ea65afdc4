"""Scoring benchmark answers, and the per-problem statistics papers report.

A benchmark reply is scored by extracting its final answer (a `\\boxed{...}` or a regex's last match; never "any
number in the text") and comparing it with the gold answer: exactly after `normalise_answer`, or as mathematics with
math-verify (`MathVerifier`, which runs sympy in a child process it can kill, since sympy can hang for ever). The
statistics: avg@k (pass@1 averaged over k samples), pass@k (Chen et al.'s unbiased estimator) and majority@k
(majority vote over the first k samples' answers).
"""
import math
import multiprocessing
import re
from collections import Counter

# -----------------------------------------------------------------------------
# statistics over one problem's samples


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chance that at least one of k samples drawn without replacement from n, of which c are correct, is correct.

    Unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on Code", the Codex paper):
    1 - C(n-c, k) / C(n, k), in the product form 1 - prod_{i=n-c+1}^{n} (1 - k/i), which neither overflows nor loses
    precision for large n."""
    if k < 1:
        raise ValueError(f"pass@k needs k >= 1, got k={k}")
    if k > n:
        raise ValueError(f"pass@k needs k <= n (the number of samples), got k={k} with n={n}")
    if not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n (correct samples among n), got c={c} with n={n}")
    if n - c < k:  # every draw of k samples holds a correct one
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def avg_at_k(scores: list[float]) -> float:
    """Mean score of one problem's k samples: pass@1 averaged over k samples, less noisy than one sample's score."""
    if not scores:
        raise ValueError("avg@k needs at least one sample's score")
    return sum(scores) / len(scores)


def majority_at_k(answers: list[str | None], scores: list[float], k: int) -> float:
    """Score of the majority answer among the FIRST k samples (NeMo-Skills' majority@k; self-consistency, Wang et al.
    2022, "Self-Consistency Improves Chain of Thought Reasoning in Language Models").

    Answers are compared after `normalise_answer`; None (no answer extracted) never wins, and where all k are None
    the problem scores 0.0. A tie goes to the answer seen first. Returns the score of the first sample carrying the
    winning answer (1.0 or 0.0 for the built-in scorers)."""
    if len(answers) != len(scores):
        raise ValueError(f"majority@k needs one score per answer, got {len(answers)} answers, {len(scores)} scores")
    if not 1 <= k <= len(answers):
        raise ValueError(f"majority@k needs 1 <= k <= the number of samples ({len(answers)}), got k={k}")
    first = {}  # normalised answer -> index of the first sample carrying it
    votes = Counter()
    for i, answer in enumerate(answers[:k]):
        if answer is None:
            continue
        key = normalise_answer(answer)
        first.setdefault(key, i)
        votes[key] += 1
    if not votes:
        return 0.0
    winner = max(votes, key=lambda key: (votes[key], -first[key]))  # most votes, then seen first
    return float(scores[first[winner]])

# -----------------------------------------------------------------------------
# extracting and normalising answers


BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")


def extract_boxed(text: str) -> str | None:
    """Content of the LAST `\\boxed{...}` or `\\fbox{...}`, nested braces matched (an escaped `\\{` or `\\}` does not
    count); None when there is none or the last one is not closed (a truncated reply has no final answer)."""
    starts = [m.end() for m in BOXED.finditer(text)]
    if not starts:
        return None
    depth, i = 1, starts[-1]
    while i < len(text):
        char = text[i]
        if char == "\\":  # \{, \} and \\ are escapes, not braces
            i += 2
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[starts[-1]:i]
        i += 1
    return None


TEXT_WRAPPER = re.compile(r"\\text\s*\{([^{}]*)\}")
THOUSANDS = re.compile(r"(?<![\d.,])\d{1,3}(?:,\d{3})+(?![\d,])")  # 1,234 and 1,234,567.5; not (1,2) nor 1,23


def normalise_answer(text: str) -> str:
    """The answer as exact matching compares it: whitespace stripped and collapsed, surrounding `$` and a trailing
    period dropped, `\\text{...}` replaced by its content, thousands separators dropped ("1,234" -> "1234"),
    lowercased. "5.0" stays "5.0": numeric equality is the math scorer's (MathVerifier)."""
    text = text.strip().rstrip(".").strip().strip("$").strip()  # "$5$." and "$5.$" alike
    text = TEXT_WRAPPER.sub(r"\1", text).strip().rstrip(".").strip()
    text = THOUSANDS.sub(lambda m: m.group(0).replace(",", ""), text)
    return " ".join(text.split()).lower()


def extract_answer(text: str, pattern: str | None) -> str | None:
    """The reply's final answer: the LAST match of `pattern` (its first group if it has one, else the whole match),
    or, when pattern is None, the last `\\boxed{...}`. None when there is no such anchor (a number somewhere in the
    prose is not an answer: no lenient fallback) or the answer is empty."""
    if pattern is None:
        answer = extract_boxed(text)
    else:
        try:
            regex = re.compile(pattern)
        except re.error as err:
            raise ValueError(f"answer pattern {pattern!r} is not a valid regular expression: {err}") from None
        matches = list(regex.finditer(text))
        if not matches:
            return None
        answer = matches[-1].group(1 if regex.groups else 0)
    if answer is None or not answer.strip():
        return None
    return answer.strip()

# -----------------------------------------------------------------------------
# exact and regex scorers


def score_exact(text: str, gold: str, pattern: str | None = None) -> tuple[str | None, float]:
    """(answer, 1.0 if it equals gold after normalise_answer else 0.0). The answer is the pattern's last match, or,
    when pattern is None, the WHOLE reply stripped (an exact match of the reply; not a \\boxed{} answer)."""
    answer = extract_answer(text, pattern) if pattern is not None else (text.strip() or None)
    if answer is None:
        return None, 0.0
    return answer, float(normalise_answer(answer) == normalise_answer(gold))


def score_regex(text: str, gold: str, pattern: str) -> tuple[str | None, float]:
    """(answer, score) like score_exact, the answer being the required pattern's last match in the reply."""
    if pattern is None:
        raise ValueError("the regex scorer needs an answer pattern (a regular expression; its first group if any)")
    return score_exact(text, gold, pattern)

# -----------------------------------------------------------------------------
# math scorer: math-verify in a child process that can be killed


def as_latex(answer: str) -> str:
    """An answer or gold as math-verify's parser finds it: inside \\boxed{} (so that a bare "3/4", "\\frac{3}{4}" or
    "2\\sqrt{3}" parses whole: unwrapped, math-verify reads "2\\sqrt{3}" as 2), unless it holds a box already."""
    answer = answer.strip()
    if BOXED.search(answer):
        return answer
    for left, right in (("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if answer.startswith(left) and answer.endswith(right) and len(answer) >= len(left) + len(right):
            answer = answer[len(left):len(answer) - len(right)].strip()
    return f"\\boxed{{{answer}}}"


def verify_worker(conn) -> None:
    """The child process: imports math-verify once, then answers (answer, gold) pairs with (True, equal) or
    (False, error) until it receives None or its pipe closes. math-verify's own SIGALRM timeouts are off: the parent's
    hard timeout, which kills this process, is the one bound on a hang."""
    import logging

    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its "timeout is disabled" warning, once per process
    configs = [LatexExtractionConfig(), ExprExtractionConfig()]

    def equal(answer: str, gold: str) -> bool:
        gold_parsed = parse(as_latex(gold), configs, parsing_timeout=None)
        answer_parsed = parse(as_latex(answer), configs, parsing_timeout=None)
        return bool(verify(gold_parsed, answer_parsed, timeout_seconds=None))

    equal("1", "1")  # compiles math-verify's regexes before the first item's clock starts
    conn.send("ready")
    while True:
        try:
            item = conn.recv()
        except EOFError:
            return
        if item is None:
            return
        try:
            conn.send((True, equal(*item)))
        except Exception as err:
            conn.send((False, f"{type(err).__name__}: {err}"))


class MathVerifier:
    """Scores replies against gold answers with math-verify (parse + verify) in a child process it owns.

    sympy can hang for ever (a power tower such as 9^{9^{9}}), and math-verify's own timeouts use SIGALRM, which
    fails outside a main thread. So each item waits at most timeout_s for the worker; past it the worker is killed and
    a fresh one started for the next item, and the item scores 0.0 (counted in `timeouts`). A worker that dies
    mid-item scores it 0.0 too (counted in `errors`, as are items whose verification raised). Use it as a context
    manager, or call close()."""

    def __init__(self, start_timeout_s: float = 120.0):
        self.start_timeout_s = start_timeout_s  # a worker's start-up: python, sympy and math-verify imports
        self.timeouts = 0
        self.errors = 0
        self.ctx = multiprocessing.get_context("spawn")  # not fork: the parent may hold threads (Ray, vLLM, torch)
        self.proc = None
        self.conn = None

    def start(self) -> None:
        """Starts a worker and waits until it has imported math-verify."""
        conn, child_conn = self.ctx.Pipe()
        proc = self.ctx.Process(target=verify_worker, args=(child_conn,), name="math-verify", daemon=True)
        proc.start()
        child_conn.close()  # the child's end lives in the child only: its death reads as EOF here
        try:
            ready = conn.poll(self.start_timeout_s) and conn.recv() == "ready"
        except (EOFError, OSError):
            ready = False
        if not ready:
            self.proc, self.conn = proc, conn
            self.stop()
            raise RuntimeError(f"the math-verify worker did not start within {self.start_timeout_s} s (exit code "
                               f"{proc.exitcode}); is math-verify installed?")
        self.proc, self.conn = proc, conn

    def stop(self) -> None:
        """Stops the worker, however busy: SIGTERM, then SIGKILL."""
        if self.proc is None:
            return
        self.conn.close()
        self.proc.terminate()
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.proc = self.conn = None

    def close(self) -> None:
        """Asks the worker to exit, and stops it if it does not."""
        if self.proc is not None and self.proc.is_alive():
            try:
                self.conn.send(None)
                self.proc.join(5)
            except OSError:
                pass
        self.stop()

    def __enter__(self) -> "MathVerifier":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def send(self, item: tuple[str, str]) -> None:
        """Sends an item to a live worker: one started if there is none, or restarted if it died between items."""
        for attempt in range(2):
            if self.proc is None or not self.proc.is_alive():
                self.stop()
                self.start()
            try:
                self.conn.send(item)
                return
            except OSError:  # it died just now: the item is not at fault, send it again to a fresh worker
                self.stop()
        raise RuntimeError("the math-verify worker died twice before it could receive an item")

    def verify_one(self, answer: str, gold: str, timeout_s: float) -> float:
        """1.0 if the worker finds answer equal to gold within timeout_s, else 0.0."""
        self.send((answer, gold))
        if not self.conn.poll(timeout_s):
            self.timeouts += 1
            self.stop()  # a fresh worker starts with the next item
            return 0.0
        try:
            ok, result = self.conn.recv()
        except (EOFError, OSError):  # it died on this item (a crash, out of memory)
            self.errors += 1
            self.stop()
            return 0.0
        if not ok:
            self.errors += 1
            return 0.0
        return float(result)

    def score(self, texts: list[str], golds: list[str], pattern: str | None = None,
              timeout_s: float = 5.0) -> list[tuple[str | None, float]]:
        """(answer, score) per reply: its answer extracted here (extract_answer: the pattern's last match, or the last
        \\boxed{}), compared with its gold by math-verify in the worker. An item past timeout_s scores 0.0. A repeated
        (answer, gold) pair is verified once (many samples of a problem often share an answer); each item of a pair
        that timed out counts in `timeouts`."""
        if len(texts) != len(golds):
            raise ValueError(f"one gold answer per reply: got {len(texts)} replies and {len(golds)} golds")
        results, seen = [], {}  # seen: (answer, gold) -> (score, timed out)
        for text, gold in zip(texts, golds):
            answer = extract_answer(text, pattern)
            if answer is None:
                results.append((None, 0.0))
                continue
            key = (answer, str(gold))
            if key in seen:
                self.timeouts += seen[key][1]
            else:
                before = self.timeouts
                seen[key] = (self.verify_one(answer, str(gold), timeout_s), self.timeouts > before)
            results.append((answer, seen[key][0]))
        return results
