"""Stage `preprocess`: the experiment's datasets -> prompt/response rows in the model's own format.

Four datasets (config `data.sft`, `data.preference`, `data.prompts`, `data.eval`), each a user's file or a built-in
one (runtime/builtin_data.py), read with the keys the config names. One job per dataset the DAG reads
(`preprocess/sft`, `preprocess/pairs`, `preprocess/prompts`, the last with the eval prompts), so that adding a
dataset to an experiment reruns only the stages that read it. A row's input becomes the text the model
continues (the chat template, with `data.system_prompt`, or `data.input_template` for a base model); a response
ends with the template's end of turn. Rows whose prompt is longer than `max_prompt_tokens` are dropped, and those
whose response is longer than `max_response_tokens` dropped or cut (`long_responses`); stats.json and the log count
both. Without an eval dataset, a seeded `eval_fraction` of the prompts is held out, as it always is of the SFT rows
and the pairs (their held-out loss and accuracy). Output keys follow OpenRLHF's (prompt, response, label, chosen,
rejected):

  sft/sft_train, sft/sft_eval           prompt, response
  pairs/pairs_train, pairs/pairs_eval   prompt, chosen, rejected (, margin)
  prompts/prompts_train (with RL's prompts), prompts/prompts_eval   prompt, input (the row's own text, for
                                        reading), label (, response)

    .venv/bin/snakemake --profile cluster_profiles/local results/<experiment>/preprocess/sft
"""
import dataclasses
import json
import random
import statistics
from pathlib import Path

from runtime import data
from runtime.builtin_data import builtin_rows
from runtime.models import end_of_turn, load_tokenizer
from runtime.user_data import is_builtin, load_records

USES_RAY = False
DATASET_ROLES = {"sft": ("sft",), "pairs": ("preference",), "prompts": ("prompts", "eval")}


@dataclasses.dataclass
class Config:
    dataset: str | None  # sft, pairs or prompts: what this job writes (launcher/config.preprocess_params)
    sft: dict | None  # a data.<role> block; None where the job does not read it
    preference: dict | None
    prompts: dict | None
    eval: dict | None
    apply_chat_template: bool
    input_template: str | None
    system_prompt: str | None
    max_prompt_tokens: int
    max_response_tokens: int
    long_responses: str
    builtin: dict
    seed: int

    @classmethod
    def from_params(cls, params: dict) -> "Config":
        data = dict.fromkeys(("sft", "preference", "prompts", "eval")) | params["data"]
        return cls(**data, dataset=params.get("dataset"), seed=params["seed"])


class Formatter:
    """Rows in the model's format, with the length limits applied and counted per dataset."""

    def __init__(self, cfg: Config, tokenizer):
        self.cfg, self.tokenizer = cfg, tokenizer
        self.end = end_of_turn(tokenizer)
        self.stats: dict = {}

    def count(self, role: str, key: str, amount=1) -> None:
        self.stats.setdefault(role, {}).setdefault(key, 0)
        self.stats[role][key] += amount

    def tokens(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def prompt(self, value) -> str:
        """An input (text, or chat messages) as the text the model continues."""
        cfg = self.cfg
        if not cfg.apply_chat_template:
            if not isinstance(value, str):
                raise ValueError("chat messages need data.apply_chat_template: true (and a model with a chat template)")
            return cfg.input_template.format(value) if cfg.input_template else value
        messages = [{"role": "user", "content": value}] if isinstance(value, str) else value
        if isinstance(value, str) and cfg.system_prompt is not None:  # otherwise the template's own, if any
            messages = [{"role": "system", "content": cfg.system_prompt}, *messages]
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def fit_response(self, text: str) -> str | None:
        """A reply as the model learns it: ending with the end of turn; None if too long to keep."""
        ids = self.tokens(text + self.end)
        if len(ids) <= self.cfg.max_response_tokens:
            return text + self.end
        if self.cfg.long_responses == "drop":
            return None
        # Cut: no end of turn, the reply goes on. Text decoded from a cut can re-encode longer: cut until it fits.
        keep = self.cfg.max_response_tokens
        while len(self.tokens(cut := self.tokenizer.decode(ids[:keep]))) > self.cfg.max_response_tokens:
            keep -= 1
        return cut

    def fits_prompt(self, role: str, prompt: str) -> bool:
        tokens = len(self.tokens(prompt))
        if tokens > self.cfg.max_prompt_tokens:
            self.count(role, "dropped_long_prompt")
            return False
        self.stats.setdefault(role, {}).setdefault("prompt_tokens", []).append(tokens)
        return True

    def response(self, role: str, text: str) -> str | None:
        fitted = self.fit_response(text)
        if fitted is None:
            self.count(role, "dropped_long_response")
        elif not fitted.endswith(self.end):
            self.count(role, "truncated_response")
        if fitted is not None:
            self.stats.setdefault(role, {}).setdefault("response_tokens", []).append(len(self.tokens(fitted)))
        return fitted

    def sft(self, row: dict, spec: dict) -> dict | None:
        if spec["messages_key"]:
            messages = row[spec["messages_key"]]
            prompt, reply = self.prompt(messages[:-1]), messages[-1]["content"]
        else:
            prompt, reply = self.prompt(row[spec["input_key"]]), row[spec["output_key"]]
        if not self.fits_prompt("sft", prompt) or (response := self.response("sft", reply)) is None:
            return None
        return {"prompt": prompt, "response": response}

    def pair(self, row: dict, spec: dict) -> dict | None:
        """A pair as prompt/chosen/rejected text: chat message lists go through the chat template; without a
        prompt, the conversation before the last message of `chosen` is the prompt."""
        chosen, rejected = row[spec["chosen_key"]], row[spec["rejected_key"]]
        if row.get(spec["prompt_key"]) is not None:
            prompt = self.prompt(row[spec["prompt_key"]])
        else:
            prompt = self.prompt(chosen[:-1]) if isinstance(chosen, list) and len(chosen) > 1 else ""
        last = lambda value: value if isinstance(value, str) else value[-1]["content"]
        if prompt and not self.fits_prompt("preference", prompt):
            return None
        chosen, rejected = self.response("preference", last(chosen)), self.response("preference", last(rejected))
        if chosen is None or rejected is None:
            return None
        pair = {"prompt": prompt, "chosen": chosen, "rejected": rejected}
        if spec["margin_key"]:
            pair["margin"] = float(row[spec["margin_key"]])
        return pair

    def prompt_row(self, row: dict, spec: dict, role: str) -> dict | None:
        value = row[spec["input_key"]]
        prompt = self.prompt(value)
        if not self.fits_prompt(role, prompt):
            return None
        out = {"prompt": prompt, "input": value if isinstance(value, str) else value[-1]["content"],
               "label": row[spec["label_key"]] if spec["label_key"] else None}
        if spec.get("output_key"):
            out["response"] = row[spec["output_key"]]
        return out


def read_rows(role: str, spec: dict, cfg: Config, formatter: Formatter) -> list[dict]:
    if is_builtin(spec["path"]):
        tokenizer = formatter.tokenizer
        as_seen = lambda texts: tokenizer.batch_decode(
            [ids[:cfg.max_response_tokens] for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]])
        return builtin_rows(spec["path"], role, spec["max_samples"], cfg.seed, cfg.builtin, as_seen)
    return load_records(spec)


def hold_out(rows: list[dict], fraction: float, seed: int) -> tuple[list[dict], list[dict]]:
    """(train, held out): a seeded shuffle, then round(fraction * rows), at least one, held out."""
    rows = rows[:]
    random.Random(seed).shuffle(rows)
    count = max(1, round(fraction * len(rows)))
    return rows[count:], rows[:count]


def run(cfg: Config, inputs: dict, output: Path, tracker) -> None:
    tokenizer = load_tokenizer(inputs["model"])
    if cfg.apply_chat_template and not tokenizer.chat_template:
        raise ValueError("data.apply_chat_template is true but the model has no chat template: set it to false and "
                         "give data.input_template (e.g. \"User: {}\\nAssistant: \")")
    formatter = Formatter(cfg, tokenizer)
    formatted = {}
    for role, convert in (("sft", formatter.sft), ("preference", formatter.pair),
                          ("prompts", lambda row, spec: formatter.prompt_row(row, spec, "prompts")),
                          ("eval", lambda row, spec: formatter.prompt_row(row, spec, "eval"))):
        spec = getattr(cfg, role)
        if role not in DATASET_ROLES[cfg.dataset] or not spec["path"]:
            continue
        rows = read_rows(role, spec, cfg, formatter)
        formatter.count(role, "rows_read", len(rows))
        formatted[role] = [out for row in rows if (out := convert(row, spec)) is not None]
        if len(formatted[role]) < 2:
            raise ValueError(f"data.{role} ({spec['path']}) has {len(formatted[role])} usable rows of {len(rows)} "
                             f"read (stats: {formatter.stats[role]}); it needs at least 2: raise data.max_prompt_tokens "
                             "/ max_response_tokens or set long_responses: truncate")
    splits = {}
    if "sft" in formatted:
        splits["sft_train"], splits["sft_eval"] = hold_out(formatted["sft"], cfg.sft["eval_fraction"], cfg.seed)
    if "preference" in formatted:
        splits["pairs_train"], splits["pairs_eval"] = hold_out(formatted["preference"],
                                                               cfg.preference["eval_fraction"], cfg.seed)
    if "eval" in formatted:  # RL's prompts (if any) all train
        if "prompts" in formatted:
            splits["prompts_train"] = formatted["prompts"]
        splits["prompts_eval"] = formatted["eval"]
    elif "prompts" in formatted:
        splits["prompts_train"], splits["prompts_eval"] = hold_out(formatted["prompts"], cfg.prompts["eval_fraction"],
                                                                   cfg.seed)
    for name, rows in splits.items():
        data.write_jsonl(output / f"{name}.jsonl", [{"id": i, **row} for i, row in enumerate(rows)])
    summary = {f"rows_{name}": len(rows) for name, rows in splits.items()}
    for role, stats in formatter.stats.items():
        for key, value in stats.items():
            if isinstance(value, list):
                summary[f"{role}_{key}_mean"], summary[f"{role}_{key}_max"] = statistics.fmean(value), max(value)
            else:
                summary[f"{role}_{key}"] = value
    (output / "stats.json").write_text(json.dumps(summary, indent=2))
    tracker.log_metrics(summary)
    tracker.log_artifact(output / "stats.json")
    print("[preprocess] " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                      for k, v in summary.items()), flush=True)
