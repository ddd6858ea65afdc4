"""LLM-as-a-judge reward: a rubric prompt per (prompt, reply, label), a judge model's greedy verdict, a score parsed
from it.

Settings: `template` (a str.format template over {prompt}, {completion} and {label}), `chat` (wrap the rubric in the
judge's chat template), `parser` (how a verdict becomes a number: the first number in a range, or the earliest of
named choices), `unparsed_score` (what a verdict without a score gets) and `max_new_tokens`. The judge model itself
is the caller's: it passes `generate`, so the same Judge runs on vLLM in a stage and on a script in a test.
"""
import math
import re
import string

PLACEHOLDERS = ("prompt", "completion", "label")
# The first number of a verdict: optional sign, int or decimal ("Score: 8/10" -> 8, "7.5 out of 10" -> 7.5).
NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")
EXAMPLES_KEPT = 5
# The judge engine's max_model_len, at most (its model's positions cap it): a longer rubric keeps its last tokens,
# where the reply and the request for a score are.
JUDGE_CONTEXT = 4096


class JudgeError(ValueError):
    """A judge setting that cannot work; names the key."""


def check_settings(settings: dict, where: str) -> None:
    """JudgeError naming f"{where}.<key>" for a template or parser that cannot give a score, before any job runs."""
    _check_template(settings["template"], f"{where}.template")
    parser = settings["parser"]
    if parser["kind"] == "number":
        if parser["min"] >= parser["max"]:
            raise JudgeError(f"{where}.parser.min ({parser['min']}) must be below {where}.parser.max "
                             f"({parser['max']})")
        if parser.get("pattern") is not None:
            _check_pattern(parser["pattern"], f"{where}.parser.pattern")
    elif parser["kind"] == "choice":
        if not parser["choices"]:
            raise JudgeError(f"{where}.parser.choices is empty; give the verdicts and their scores, "
                             "e.g. {\"yes\": 1.0, \"no\": 0.0}")
    else:
        raise JudgeError(f"{where}.parser.kind is {parser['kind']!r}; it is number or choice")


def _check_template(template: str, key: str) -> None:
    valid = ", ".join(f"{{{name}}}" for name in PLACEHOLDERS)
    try:
        # Formatter's parse yields each literal run with the field after it; {{ }} come back as literal braces.
        fields = [field for _, field, _, _ in string.Formatter().parse(template) if field is not None]
    except ValueError as err:
        raise JudgeError(f"{key} is not a format string ({err}); write a literal brace as {{{{ or }}}}") from None
    unknown = [field for field in fields if field not in PLACEHOLDERS]
    if unknown:
        raise JudgeError(f"{key} has the placeholder {{{unknown[0]}}}; the placeholders are {valid} "
                         "(write a literal brace as {{ or }})")
    if "completion" not in fields:
        raise JudgeError(f"{key} has no {{completion}}: the judge would not see the reply it scores ({valid})")


def _check_pattern(pattern: str, key: str) -> None:
    try:
        compiled = re.compile(pattern)
    except re.error as err:
        raise JudgeError(f"{key} {pattern!r} is not a regular expression: {err}") from None
    if compiled.groups == 0:
        raise JudgeError(f"{key} {pattern!r} has no group; the score is its first group, e.g. r\"Score:\\s*(\\d+)\"")


def render(template: str, prompt: str, completion: str, label) -> str:
    """The judge's rubric for one row; a missing label renders as empty text."""
    return template.format(prompt=prompt, completion=completion, label="" if label is None else str(label))


def parse_score(text: str, parser: dict) -> float | None:
    """The score a verdict gives under `parser`, or None where it gives none."""
    if parser["kind"] == "choice":
        return _parse_choice(text, parser["choices"])
    if parser.get("pattern") is None:
        match = NUMBER.search(text)
        found = match and match.group(0)
    else:
        match = re.search(parser["pattern"], text)
        found = match and match.group(1)  # None too where the group did not take part in the match
    if not found:
        return None
    try:
        score = float(found)
    except ValueError:  # a pattern's group that caught something other than a number
        return None
    # A verdict outside the rubric's range is a misread (a step number, "11/10"), not a score to clip.
    return score if math.isfinite(score) and parser["min"] <= score <= parser["max"] else None


def _parse_choice(text: str, choices: dict) -> float | None:
    """The number of the choice that occurs earliest as a whole word ("yes" not in "Yesterday"); the longer choice
    where two start at the same place ("not correct" over "not")."""
    found = []
    for choice, score in choices.items():
        # Lookarounds rather than \b, so a choice that starts or ends with punctuation ("(A)") still matches;
        # any whitespace between a choice's words, as a judge may wrap lines.
        words = r"\s+".join(re.escape(word) for word in choice.split())
        match = re.search(rf"(?<!\w){words}(?!\w)", text, re.IGNORECASE)
        if match:
            found.append((match.start(), -len(match.group(0)), float(score)))
    return min(found)[2] if found else None


def judge_context(model_dir) -> int:
    """The judge engine's max_model_len: JUDGE_CONTEXT, or fewer where its model has fewer positions."""
    from runtime.models import model_positions
    return min(JUDGE_CONTEXT, model_positions(model_dir) or JUDGE_CONTEXT)


def greedy_verdicts(generate, context: int):
    """A Judge's `generate` from a vLLM engine's (runtime/rollout.VLLMEngine.generate, or generate_on over several):
    one greedy output per rubric, each rubric cut to its last `context` - max_new_tokens tokens."""
    def verdicts(prompt_ids: list[list[int]], max_new_tokens: int) -> list[str]:
        room = context - max_new_tokens
        return [out[0]["text"] for out in generate([ids[-room:] for ids in prompt_ids], 1, 0.0, 1.0, max_new_tokens, 0)]
    return verdicts


class Judge:
    """A reward function (prompts, completions, labels) -> scores, from a judge model's verdicts.

    `generate(prompt_ids, max_new_tokens)` is the judge model: one greedy output text per list of token ids.
    Counts what it judged (`rows`) and the verdicts that gave no score (`unparsed`), keeping the first few of those
    (`examples`) for the log: a template or parser that misreads the judge shows there, not as a flat reward."""

    def __init__(self, settings: dict, tokenizer, generate):
        self.settings = settings
        self.tokenizer = tokenizer
        self.generate = generate
        self.chat = settings["chat"] and bool(getattr(tokenizer, "chat_template", None))
        self.rows = 0
        self.unparsed = 0
        self.examples: list[str] = []

    def token_ids(self, text: str) -> list[int]:
        if self.chat:
            # return_dict: transformers 5 returns a BatchEncoding for tokenize=True, 4 a list unless asked.
            encoded = self.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                         add_generation_prompt=True, tokenize=True, return_dict=True)
        else:
            # The rubric is the whole prompt as written: no BOS the template does not ask for.
            encoded = self.tokenizer(text, add_special_tokens=False)
        return [int(i) for i in encoded["input_ids"]]

    def __call__(self, prompts: list[str], completions: list[str], labels: list) -> list[float]:
        template, parser = self.settings["template"], self.settings["parser"]
        prompt_ids = [self.token_ids(render(template, prompt, completion, label))
                      for prompt, completion, label in zip(prompts, completions, labels, strict=True)]
        outputs = self.generate(prompt_ids, self.settings["max_new_tokens"])
        if len(outputs) != len(prompt_ids):
            raise ValueError(f"the judge's generate gave {len(outputs)} outputs for {len(prompt_ids)} prompts")
        scores, unparsed = [], []
        for output in outputs:
            score = parse_score(output, parser)
            if score is None:
                unparsed.append(output)
                score = float(self.settings["unparsed_score"])
            scores.append(score)
        self.rows += len(scores)
        self.unparsed += len(unparsed)
        self.examples += [output[:200] for output in unparsed[:EXAMPLES_KEPT - len(self.examples)]]
        if unparsed:
            print(f"[judge] {len(unparsed)} of {len(scores)} outputs gave no score (scored "
                  f"{self.settings['unparsed_score']}); e.g. {unparsed[0]!r:.120}", flush=True)
        return scores
