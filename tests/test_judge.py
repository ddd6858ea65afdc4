"""Unit tests of runtime/judge.py: scores parsed from hand-written judge verdicts, the rubric's rendering, the
settings refused before any job, and Judge end to end with a real tokenizer and a scripted judge (the judge model is
not part of these tests: `generate` is a plain function)."""
import pytest
from transformers import AutoTokenizer

from runtime.judge import Judge, JudgeError, check_settings, parse_score, render
from runtime.models import build_tiny

SCORE_0_10 = {"kind": "number", "min": 0.0, "max": 10.0, "pattern": None}
YES_NO = {"kind": "choice", "choices": {"yes": 1.0, "no": 0.0}}
TEMPLATE = "Question: {prompt}\nReply: {completion}\nReference: {label}\nRate the reply from 0 to 10."


def settings(**changes) -> dict:
    return {"template": TEMPLATE, "chat": False, "parser": SCORE_0_10, "unparsed_score": -1.0, "max_new_tokens": 8,
            **changes}


# --- parse_score ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, score", [
    ("Score: 7", 7.0),
    ("I'd rate this 8/10.", 8.0),
    ("**9**", 9.0),
    ("7.5 out of 10", 7.5),
    ("0", 0.0),
    ("10", 10.0),
    ("Score: +3", 3.0),
    ("The reply is fine.\n\nFinal score: 6", 6.0),
])
def test_a_number_verdict_gives_its_first_number(text, score):
    assert parse_score(text, SCORE_0_10) == score


@pytest.mark.parametrize("text", ["-1", "11", "10.5 out of 10", "The answer has no score", "nan", "inf", "", "Score:"])
def test_a_number_verdict_without_a_number_in_range_gives_none(text):
    assert parse_score(text, SCORE_0_10) is None


def test_a_negative_number_counts_where_the_range_allows_it():
    assert parse_score("Score: -1", {**SCORE_0_10, "min": -5.0}) == -1.0


def test_a_pattern_takes_its_first_group_of_the_first_match():
    parser = {**SCORE_0_10, "pattern": r"Rating:\s*(\d+)"}
    assert parse_score("Step 1: check the facts. Step 2: the style.\nRating: 4", parser) == 4.0
    assert parse_score("Rating: 4. On reflection, Rating: 9", parser) == 4.0
    assert parse_score("Step 1: check the facts.", parser) is None  # without the pattern this would be 1
    assert parse_score("Rating: 12", parser) is None  # the range holds for a pattern's group too


def test_a_pattern_group_that_is_not_a_finite_number_gives_none():
    assert parse_score("Rating: nan", {**SCORE_0_10, "pattern": r"Rating:\s*(\S+)"}) is None
    assert parse_score("Rating: good", {**SCORE_0_10, "pattern": r"Rating:\s*(\S+)"}) is None
    assert parse_score("Rating: ", {**SCORE_0_10, "pattern": r"Rating:\s*(\d+)?"}) is None


@pytest.mark.parametrize("text, score", [
    ("Yes, it is correct", 1.0),
    ("no.", 0.0),
    ("NO", 0.0),
    ("Yesterday I thought so", None),  # whole words only: "Yes" in "Yesterday" is no verdict
    ("Nobody knows", None),
    ("It is not yes... no", 1.0),  # the earliest choice wins, not the first in `choices`
    ("Hmm. No -- well, yes", 0.0),
    ("I cannot tell.", None),
])
def test_a_choice_verdict_gives_its_earliest_whole_word_choice(text, score):
    assert parse_score(text, YES_NO) == score


def test_a_multi_word_choice_wins_where_it_starts_first():
    # "correct" is listed first and occurs inside "not correct": taking the first listed choice that occurs, or the
    # choice's own first occurrence regardless of the others, would read "not correct" as correct.
    parser = {"kind": "choice", "choices": {"correct": 1.0, "not correct": 0.0}}
    assert parse_score("The reply is not correct.", parser) == 0.0
    assert parse_score("The reply is NOT\ncorrect.", parser) == 0.0  # any case, words wrapped across lines
    assert parse_score("Correct. It is not correct to say otherwise.", parser) == 1.0
    assert parse_score("Incorrect.", parser) is None


def test_a_longer_choice_wins_over_one_starting_at_the_same_place():
    parser = {"kind": "choice", "choices": {"not": 0.0, "not bad": 0.5}}
    assert parse_score("not bad at all", parser) == 0.5
    assert parse_score("not good", parser) == 0.0


def test_a_choice_with_punctuation_still_matches_as_a_whole():
    parser = {"kind": "choice", "choices": {"(A)": 1.0, "(B)": 0.0}}
    assert parse_score("The better reply is (B), since (A) is wrong", parser) == 0.0


# --- render and check_settings -------------------------------------------------------------------------------------


def test_render_fills_the_three_fields():
    text = render(TEMPLATE, "What is 2+2?", "4", 4)
    assert text == "Question: What is 2+2?\nReply: 4\nReference: 4\nRate the reply from 0 to 10."
    assert render("{completion}|{label}", "p", "c", None) == "c|"
    assert render("{{not a field}} {completion}", "p", "c", None) == "{not a field} c"


def test_check_settings_accepts_the_valid_ones():
    check_settings(settings(), "judge")
    check_settings(settings(template='Reply: {completion}\nAnswer as JSON {{"score": n}}'), "judge")
    check_settings(settings(parser={**SCORE_0_10, "pattern": r"Score:\s*(\d+)"}), "judge")
    check_settings(settings(parser=YES_NO), "judge")


def test_check_settings_refuses_an_unknown_placeholder_naming_the_key_and_the_valid_ones():
    with pytest.raises(JudgeError) as err:
        check_settings(settings(template="Rate: {reply}"), "reward.judge")
    message = str(err.value)
    assert "reward.judge.template" in message and "{reply}" in message
    assert "{prompt}" in message and "{completion}" in message and "{label}" in message


@pytest.mark.parametrize("template", ["Rate {} please {completion}", "Rate {0} {completion}",
                                      "{completion} {prompt.upper}", "{completion} {label[0]}"])
def test_check_settings_refuses_positional_and_attribute_fields(template):
    with pytest.raises(JudgeError, match=r"judge\.template"):
        check_settings(settings(template=template), "judge")


def test_check_settings_refuses_a_template_that_is_no_format_string():
    with pytest.raises(JudgeError, match=r"judge\.template"):
        check_settings(settings(template="Rate {completion} as {score: n}"), "judge")
    with pytest.raises(JudgeError, match=r"judge\.template"):
        check_settings(settings(template="Rate {completion}}"), "judge")


def test_check_settings_refuses_a_template_without_the_completion():
    with pytest.raises(JudgeError, match=r"judge\.template has no \{completion\}"):
        check_settings(settings(template="Is this a good answer to {prompt}?"), "judge")


@pytest.mark.parametrize("parser, key", [
    ({**SCORE_0_10, "min": 10.0}, "judge.parser.min"),
    ({**SCORE_0_10, "min": 11.0}, "judge.parser.min"),
    ({**SCORE_0_10, "pattern": r"Score: (\d+"}, "judge.parser.pattern"),
    ({**SCORE_0_10, "pattern": r"Score: \d+"}, "judge.parser.pattern"),
    ({"kind": "choice", "choices": {}}, "judge.parser.choices"),
    ({"kind": "stars"}, "judge.parser.kind"),
])
def test_check_settings_refuses_a_parser_that_cannot_score(parser, key):
    with pytest.raises(JudgeError) as err:
        check_settings(settings(parser=parser), "judge")
    assert key in str(err.value)


# --- Judge end to end ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("judge_model")
    texts = [TEMPLATE, "Score: 7 out of 10. The reply is correct.", "What is 2+2? It is 4."] * 20
    build_tiny(model_dir, {"architecture": "qwen2", "hidden_size": 32, "num_layers": 1, "num_heads": 2,
                           "vocab_size": 300}, 0, texts)
    return AutoTokenizer.from_pretrained(model_dir)


class ScriptedJudge:
    """A judge model's generate that answers from a script and records what it was given."""

    def __init__(self, *outputs: str):
        self.outputs = list(outputs)
        self.calls = []

    def __call__(self, prompt_ids, max_new_tokens):
        self.calls.append((prompt_ids, max_new_tokens))
        answers, self.outputs = self.outputs[:len(prompt_ids)], self.outputs[len(prompt_ids):]
        return answers


ROWS = (["What is 2+2?", "What is 3+3?", "Name a colour."], ["4", "7", "blue"], ["4", "6", None])


def test_judge_scores_each_row_and_counts_what_gave_no_score(tokenizer, capsys):
    generate = ScriptedJudge("Score: 9", "I cannot judge this one.", "8/10",
                             "Rating pending", "**3**", "")
    judge = Judge(settings(unparsed_score=-1.0, max_new_tokens=16), tokenizer, generate)
    assert judge(*ROWS) == [9.0, -1.0, 8.0]
    assert (judge.rows, judge.unparsed) == (3, 1)
    assert capsys.readouterr().out == ("[judge] 1 of 3 outputs gave no score (scored -1.0); "
                                       "e.g. 'I cannot judge this one.'\n")
    assert judge(*ROWS) == [-1.0, 3.0, -1.0]
    assert (judge.rows, judge.unparsed) == (6, 3)
    assert judge.examples == ["I cannot judge this one.", "Rating pending", ""]
    assert "[judge] 2 of 3 outputs gave no score (scored -1.0); e.g. 'Rating pending'" in capsys.readouterr().out
    assert [max_new_tokens for _, max_new_tokens in generate.calls] == [16, 16]


def test_judge_prints_nothing_when_every_output_parses(tokenizer, capsys):
    judge = Judge(settings(), tokenizer, ScriptedJudge("1", "2", "3"))
    assert judge(*ROWS) == [1.0, 2.0, 3.0]
    assert judge.unparsed == 0 and judge.examples == []
    assert capsys.readouterr().out == ""


def test_judge_keeps_the_first_five_unparsed_outputs_cut_to_200_characters(tokenizer, capsys):
    long = "I will think step by step. " * 20
    judge = Judge(settings(unparsed_score=0.5), tokenizer, ScriptedJudge(long, *(f"verdict {c}" for c in "abcdefg")))
    for _ in range(4):
        assert set(judge(ROWS[0][:2], ROWS[1][:2], ROWS[2][:2])) == {0.5}
    assert judge.unparsed == 8
    assert judge.examples == [long[:200], "verdict a", "verdict b", "verdict c", "verdict d"]
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and lines[0].startswith("[judge] 2 of 2 outputs gave no score (scored 0.5); e.g. 'I will")
    assert len(lines[0]) < 200  # the example in the line is cut to 120 characters


def test_judge_with_chat_wraps_the_rubric_in_the_chat_template(tokenizer):
    generate = ScriptedJudge("Score: 5")
    Judge(settings(chat=True), tokenizer, generate)(["What is 2+2?"], ["4"], ["4"])
    [ids] = generate.calls[0][0]
    assert all(type(i) is int for i in ids)
    assert tokenizer.decode(ids) == ("<|im_start|>user\n" + render(TEMPLATE, "What is 2+2?", "4", "4")
                                     + "<|im_end|>\n<|im_start|>assistant\n")


def test_judge_without_chat_gives_the_rubric_as_written(tokenizer):
    generate = ScriptedJudge("Score: 5")
    Judge(settings(chat=False), tokenizer, generate)(["What is 2+2?"], ["4"], [None])
    [ids] = generate.calls[0][0]
    assert all(type(i) is int for i in ids)
    assert tokenizer.decode(ids) == render(TEMPLATE, "What is 2+2?", "4", None)
    assert "<|im_start|>" not in tokenizer.decode(ids)


def test_judge_with_chat_and_a_tokenizer_without_a_template_gives_the_rubric_as_written(tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer, "chat_template", None)
    generate = ScriptedJudge("Score: 5")
    Judge(settings(chat=True), tokenizer, generate)(["What is 2+2?"], ["4"], ["4"])
    assert tokenizer.decode(generate.calls[0][0][0]) == render(TEMPLATE, "What is 2+2?", "4", "4")


def test_judge_refuses_a_generate_that_gives_the_wrong_number_of_outputs(tokenizer):
    with pytest.raises(ValueError, match="2 outputs for 3 prompts"):
        Judge(settings(), tokenizer, lambda ids, n: ["1", "2"])(*ROWS)
