"""Users' preference files: checked row by row before anything runs, then turned into prompt/chosen/rejected."""
import dataclasses
import json
import random

import pytest

from pipeline_helpers import snakemake, write_config
from stages import preprocess
from runtime.data import PreferenceDataError, read_preference_file
from runtime.models import train_tiny_tokenizer


def write_rows(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


GOOD = [
    {"prompt": "Review this film.", "chosen": "A delight.", "rejected": "A bore."},
    {"chosen": [{"role": "user", "content": "Thoughts?"}, {"role": "assistant", "content": "Loved it."}],
     "rejected": [{"role": "user", "content": "Thoughts?"}, {"role": "assistant", "content": "Hated it."}],
     "margin": 0.5},
    {"chosen": "plain text, no prompt", "rejected": "another plain text"},
]


def test_good_rows_pass(tmp_path):
    assert len(read_preference_file(write_rows(tmp_path / "p.jsonl", GOOD))) == 3


@pytest.mark.parametrize("bad, fragment", [
    ({"prompt": "p", "chosen": "yes"}, "missing key 'rejected'"),
    ({"prompt": "p", "chosen": "   ", "rejected": "no"}, "'chosen' is empty"),
    ({"prompt": "p", "chosen": "same", "rejected": "same"}, "identical"),
    ({"chosen": [{"role": "assistant", "content": ""}], "rejected": "x"}, "chosen[0].content is empty"),
    ({"chosen": 3, "rejected": "x"}, "must be a non-empty string or a list of chat messages"),
    ({"chosen": "a", "rejected": "b", "margin": "big"}, "margin must be a number"),
])
def test_bad_row_names_file_and_line(tmp_path, bad, fragment):
    path = write_rows(tmp_path / "prefs.jsonl", [GOOD[0], bad])
    with pytest.raises(PreferenceDataError) as err:
        read_preference_file(path)
    assert f"{path}, line 2" in str(err.value) and fragment in str(err.value)


def test_rows_become_templated_pairs(tmp_path):
    tokenizer = train_tiny_tokenizer(["a delight a bore loved it hated it thoughts review this film"] * 20, 300)
    cfg = preprocess.Config(source="imdb", prompt_words=4, max_prompt_tokens=200, max_response_tokens=100,
                            num_train=1, num_eval=1, instruction="x", system_prompt=None, num_pairs_train=1, num_pairs_eval=1, pair_min_sentiment=0.5, num_rl_prompts=1,
                            preference_train_file=None, preference_eval_file=None, seed=0)
    stats = {"dropped_short": 0, "dropped_long_prompt": 0, "truncated_response": 0, "prompt_tokens": [],
             "response_tokens": []}
    pairs = preprocess.user_pairs(str(write_rows(tmp_path / "p.jsonl", GOOD)), cfg, tokenizer, stats)
    assert pairs[0]["prompt"] == "<|im_start|>user\nReview this film.<|im_end|>\n<|im_start|>assistant\n"
    assert pairs[0]["chosen"] == "A delight.<|im_end|>"
    assert pairs[1]["prompt"] == "<|im_start|>user\nThoughts?<|im_end|>\n<|im_start|>assistant\n"
    assert (pairs[1]["chosen"], pairs[1]["rejected"], pairs[1]["margin"]) == ("Loved it.<|im_end|>", "Hated it.<|im_end|>", 0.5)
    assert pairs[2]["prompt"] == ""


def test_bad_file_stops_snakemake_before_any_stage(tmp_path):
    bad = write_rows(tmp_path / "prefs.jsonl", [GOOD[0], {"prompt": "p", "chosen": "same", "rejected": "same"}])
    configfile = write_config(tmp_path / "c.yaml", tmp_path / "results",
                              data={"preference_train_file": str(bad), "preference_eval_file": str(bad)})
    proc = snakemake(configfile, "all", check=False)
    assert proc.returncode != 0
    assert f"{bad}, line 2: chosen and rejected are identical" in proc.stdout + proc.stderr
    assert not (tmp_path / "results").exists()


def test_generated_pairs_read_positive_and_negative():
    tokenizer = train_tiny_tokenizer(["a fine film, a bad film"] * 20, 300)
    reviews = [{"text": "opening words of this review: a wonderful, brilliant and moving film", "label": 1},
               {"text": "opening words of this review: the plot goes here and there", "label": 1},
               {"text": "opening words of this review: awful, boring, a terrible waste", "label": 0},
               {"text": "opening words of this review: it was shown on a tuesday", "label": 0}]
    cfg = preprocess.Config(source="imdb", prompt_words=5, max_prompt_tokens=200, max_response_tokens=100,
                            num_train=1, num_eval=1, instruction="x", system_prompt=None, num_pairs_train=4, num_pairs_eval=1,
                            pair_min_sentiment=0.5, num_rl_prompts=1, preference_train_file=None,
                            preference_eval_file=None, seed=0)
    stats = {"dropped_short": 0, "dropped_long_prompt": 0, "truncated_response": 0, "prompt_tokens": [],
             "response_tokens": []}
    pairs = preprocess.make_pairs(reviews, 4, cfg, tokenizer, stats, random.Random(0))
    # Only the clearly worded continuations survive the filter; the neutral ones never appear.
    assert {p["chosen"] for p in pairs} == {" a wonderful, brilliant and moving film<|im_end|>"}
    assert {p["rejected"] for p in pairs} == {" awful, boring, a terrible waste<|im_end|>"}
    assert len(stats["response_tokens"]) == 8
    with pytest.raises(ValueError, match=r"pair_min_sentiment \(0.99\)"):
        preprocess.make_pairs(reviews, 4, dataclasses.replace(cfg, pair_min_sentiment=0.99), tokenizer, stats,
                              random.Random(0))
