"""Multi-turn episodes (runtime/environments.py) with a scripted engine: canned replies instead of vLLM, a tiny model's
ChatML tokenizer and environments written in the test. What the trainer sees of an episode (ids, mask, log-probs,
rewards), the limits that end one, environments that hang or raise, and the policy loss's gradient at the
environment's tokens."""
import time

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from launcher.config import stage_config
from runtime import models, rl_actors
from runtime.environments import (EpisodeRunner, EnvironmentFileError, load_environment, parse_tool_calls,
                                  turn_seed)
from runtime.experience import Rollout, place_rewards
from runtime.rl_actors import PolicyWorker
from stages import rl

SETTINGS = {"max_turns": 3, "max_episode_tokens": 400, "max_env_tokens": 64, "timeout": 5, "isolation": "thread",
            "concurrency": 8, "on_error": "end", "turn_rewards": False}

ECHO = '''
import time
SEEN = []
class Environment:
    def reset(self, prompt, label, seed):
        SEEN.append((prompt, seed))
        self.label = label
        return [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": prompt}]
    def step(self, reply):
        if reply.text == "sleep":
            time.sleep(30)
        if reply.text == "raise":
            raise KeyError("no such tool")
        if reply.text == self.label:
            return [], 1.0, True, {"success": True}
        return [{"role": "user", "content": "Wrong: " + reply.text}], 0.25, False
'''


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("tiny-chat")
    models.build_tiny(model_dir, {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "vocab_size": 300}, 0,
                      ["What is 12 + 30? 42", "Wrong answer, try again.", "Answer with a number."] * 20)
    return models.load_tokenizer(model_dir)


@pytest.fixture()
def echo(tmp_path):
    path = tmp_path / "echo.py"
    path.write_text(ECHO)
    return path


class ScriptedEngine:
    """Replies from a script, by episode and turn; each ends with the end of turn unless `cut` says it was cut at
    max_new_tokens. Records every call's seeds and token limits."""

    def __init__(self, tokenizer, runner, script, cut=()):
        self.tokenizer, self.eot, self.script, self.cut = tokenizer, runner.format.eot_ids, script, set(cut)
        self.calls, self.turn = [], 0

    def __call__(self, contexts, seeds, max_tokens):
        self.calls.append((seeds, max_tokens))
        out = []
        for episode, (context, limit) in enumerate(zip(contexts, max_tokens)):
            text = self.script(len(self.calls) - 1, context)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            ids = (ids + ([] if (len(self.calls) - 1, text) in self.cut else self.eot))[:limit]
            out.append({"token_ids": ids, "logprobs": [-0.5] * len(ids), "text": text})
        return out


def play(tokenizer, path, replies, n=1, settings=None, prompts=None, cut=()):
    runner = EpisodeRunner(SETTINGS | (settings or {}), path, tokenizer, 4096)
    engine = ScriptedEngine(tokenizer, runner, lambda turn, context: replies[turn], cut)
    prompts = prompts or [{"prompt": "<rendered>", "input": "What is 12 + 30?", "label": "42", "prompt_ids": [1]}]
    return runner, engine, runner.run(engine, prompts, n, seed=7, max_new_tokens=16)


def test_trained_ids_are_the_prompt_the_replies_as_sampled_and_the_rendered_observations(tokenizer, echo):
    runner, _, [(episode, stats)] = play(tokenizer, echo, ["41", "42"])
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
    system, user = {"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "What is 12 + 30?"}
    prompt = encode(tokenizer.apply_chat_template([system, user], tokenize=False, add_generation_prompt=True))
    eot, boundary = encode("<|im_end|>"), encode("\n")
    observation = encode("<|im_start|>user\nWrong: 41<|im_end|>\n<|im_start|>assistant\n")
    reply1, reply2 = encode("41") + eot, encode("42") + eot
    assert episode.prompt_ids == prompt
    assert episode.ids == reply1 + boundary + observation + reply2
    assert episode.mask == [1.0] * len(reply1) + [0.0] * len(boundary + observation) + [1.0] * len(reply2)
    assert [lp for lp, m in zip(episode.logprobs, episode.mask) if not m] == [0.0] * len(boundary + observation)
    # each step's reward at its reply's last token (the end of turn the model sampled); nothing elsewhere
    rewards = {i: r for i, r in enumerate(episode.rewards) if r}
    assert rewards == {len(reply1) - 1: 0.25, len(episode.ids) - 1: 1.0}
    assert stats == stats | {"turns": 2, "env_tokens": len(boundary + observation), "truncated": False, "error": None,
                             "timeout": False, "success": True, "drift": False, "reward": 1.25}
    # the conversation the chat template renders is the trained text, token for token
    rendered = tokenizer.apply_chat_template(episode.messages, tokenize=False)
    assert encode(rendered)[:len(prompt + episode.ids)] == prompt + episode.ids


def test_the_rollout_trains_the_replies_only_and_rewards_the_last_reply_token(tokenizer, echo):
    _, _, played = play(tokenizer, echo, ["41", "42"])
    episode, stats = played[0]
    row = Rollout.of([episode.prompt_ids], [episode.ids], masks=[episode.mask], rollout_logp=[episode.logprobs],
                     env_rewards=[episode.rewards], episodes=[stats])
    assert row.mask[0].tolist() == episode.mask and row.lengths().tolist() == [len(episode.ids)]
    assert row.last_trained().tolist() == [len(episode.ids) - 1]
    batch = row.tokens(0)
    assert batch["loss_mask"][0, len(episode.prompt_ids):len(episode.prompt_ids) + len(episode.ids)].tolist() == \
        episode.mask


def test_step_rewards_sit_at_their_replies_or_all_at_the_last_reply():
    """Two episodes of 2 and 1 replies (mask 0 between them): the score (step rewards 0.25 and 1.0, plus a final
    reward 0.5) all at the last reply's last token, or with turn_rewards each step's at its own reply."""
    row = Rollout.of([[1], [1]], [[5, 6, 0, 0, 7, 8], [5, 6]], masks=[[1, 1, 0, 0, 1, 1], [1, 1]],
                     env_rewards=[[0, 0.25, 0, 0, 0, 1.0], [0, 1.0]])
    scores = row.env_rewards.sum(-1) + 0.5
    assert place_rewards(row, scores, False).tolist() == [[0, 0, 0, 0, 0, 1.75], [0, 1.5, 0, 0, 0, 0]]
    assert place_rewards(row, scores, True).tolist() == [[0, 0.25, 0, 0, 0, 1.5], [0, 1.5, 0, 0, 0, 0]]


def test_a_reply_cut_at_max_new_tokens_gets_an_untrained_end_of_turn(tokenizer, echo):
    runner, _, [(episode, stats)] = play(tokenizer, echo, ["41", "42"], cut={(0, "41")})
    reply = tokenizer("41", add_special_tokens=False)["input_ids"]
    eot = runner.format.eot_ids
    assert episode.ids[:len(reply) + len(eot)] == reply + eot
    assert episode.mask[:len(reply) + len(eot)] == [1.0] * len(reply) + [0.0] * len(eot)
    assert stats["turns"] == 2 and not stats["drift"]
    assert stats["env_tokens"] == episode.mask.count(0.0) - len(eot)  # (the end of turn is no environment's)


def test_max_turns_and_the_token_budget_end_episodes(tokenizer, echo):
    _, engine, [(episode, stats)] = play(tokenizer, echo, ["1", "2", "3", "4"], settings={"max_turns": 2})
    assert stats["turns"] == 2 and not stats["truncated"] and len(engine.calls) == 2
    assert episode.ids[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")  # no observation after the last reply
    # a reply that runs into the episode's budget: cut there, the episode truncated
    _, engine, [(episode, stats)] = play(tokenizer, echo, ["123456789012345"], settings={"max_episode_tokens": 6})
    assert engine.calls[0][1] == [6] and len(episode.ids) == 6 and stats["truncated"] and stats["turns"] == 1
    # an observation that leaves no room for a reply ends the episode before it
    _, engine, [(episode, stats)] = play(tokenizer, echo, ["1", "2"], settings={"max_episode_tokens": 12})
    assert stats["truncated"] and stats["turns"] == 1 and len(engine.calls) == 1 and stats["env_tokens"] == 0


def test_a_long_observation_is_cut_to_max_env_tokens(tokenizer, echo):
    long = "9" * 200
    _, _, [(episode, stats)] = play(tokenizer, echo, [long, "42"], settings={"max_env_tokens": 5})
    observation = episode.messages[3]["content"]
    assert len(tokenizer(observation, add_special_tokens=False)["input_ids"]) == 5
    assert episode.messages[0]["content"] == "Answer with a number."  # (reset's messages are the task: not cut)
    assert stats["env_tokens"] < 40


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_a_sleeping_environment_times_out_and_a_raising_one_is_recorded(tokenizer, echo, isolation):
    t0 = time.monotonic()
    _, _, played = play(tokenizer, echo, ["sleep", "x"], n=1,
                        settings={"timeout": 1, "isolation": isolation})
    (episode, stats), = played
    assert stats["timeout"] and "did not return within 1 s" in stats["error"] and stats["turns"] == 1
    assert time.monotonic() - t0 < 20  # (a process's start included)
    _, _, [(episode, stats)] = play(tokenizer, echo, ["raise", "42"], settings={"isolation": isolation})
    assert "KeyError" in stats["error"] and "no such tool" in stats["error"] and stats["turns"] == 1
    assert not stats["timeout"]
    # on_error: observe: the error is the next message, and the episode goes on
    _, _, [(episode, stats)] = play(tokenizer, echo, ["raise", "42"], settings={"on_error": "observe"})
    assert stats["turns"] == 2 and stats["success"] and "no such tool" in episode.messages[3]["content"]


def test_the_episodes_of_a_group_share_the_environment_seed(tokenizer, echo):
    prompts = [{"prompt": "p", "input": f"What is {i} + 1?", "label": str(i + 1), "prompt_ids": [1]} for i in range(2)]
    runner = EpisodeRunner(SETTINGS, echo, tokenizer, 4096)
    seen = runner.env_cls.reset.__globals__["SEEN"]
    engine = ScriptedEngine(tokenizer, runner, lambda turn, context: "0")
    runner.run(engine, prompts, 3, seed=7, max_new_tokens=8)
    by_prompt = {}
    for prompt, seed in seen:
        by_prompt.setdefault(prompt, set()).add(seed)
    assert len(seen) == 6 and all(len(seeds) == 1 for seeds in by_prompt.values())
    assert len({seed for seeds in by_prompt.values() for seed in seeds}) == 2
    # every (episode, turn) has its own sampling seed, the same when the step is replayed
    first_turn = engine.calls[0][0]
    assert len(set(first_turn)) == 6 and first_turn == [turn_seed(7, i, 0) for i in range(6)]


def test_tool_calls_in_the_models_own_formats():
    hermes = 'Let me add. <tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call>'
    assert parse_tool_calls(hermes) == [{"name": "calculator", "arguments": {"expression": "1+2"}}]
    mistral = '[TOOL_CALLS][{"name": "calculator", "arguments": "{\\"expression\\": \\"3\\"}"}]'
    assert parse_tool_calls(mistral) == [{"name": "calculator", "arguments": {"expression": "3"}}]
    llama = '{"name": "calculator", "parameters": {"expression": "4"}}'
    assert parse_tool_calls(llama) == [{"name": "calculator", "arguments": {"expression": "4"}}]
    assert parse_tool_calls("The answer is 42.") == parse_tool_calls("<tool_call>not json</tool_call>") == []


@pytest.mark.parametrize("source, message", [
    ("x = 1\n", "must define class Environment"),
    ("class Environment:\n    def reset(self, prompt):\n        pass\n    def step(self, reply):\n        pass\n",
     "reset(self, prompt) cannot be called as reset(prompt, label, seed)"),
    ("class Environment:\n    def reset(self, prompt, label, seed):\n        pass\n", "no method step"),
    ("import no_such_module\n", "fails to import: ModuleNotFoundError"),
])
def test_a_bad_environment_file_is_refused_naming_it(tmp_path, source, message):
    path = tmp_path / "env.py"
    path.write_text(source)
    with pytest.raises(EnvironmentFileError, match=str(path)) as err:
        load_environment(path)
    assert message in str(err.value)
    with pytest.raises(EnvironmentFileError, match="no such file"):
        load_environment(tmp_path / "missing.py")


def test_a_model_without_a_chat_template_is_refused(tokenizer, echo):
    template, tokenizer.chat_template = tokenizer.chat_template, None
    try:
        with pytest.raises(ValueError, match="has no chat template"):
            EpisodeRunner(SETTINGS, echo, tokenizer, 4096)
    finally:
        tokenizer.chat_template = template


def test_log_probs_and_the_policy_gradient_are_zero_at_the_environment_tokens(tokenizer, echo, monkeypatch):
    """The policy's log-probs of an episode are 0 off the mask, and the policy loss's gradient at the logits that
    predict the environment's tokens is exactly 0."""
    _, _, played = play(tokenizer, echo, ["41", "42", "7"], n=2)
    episodes = [e for e, _ in played]
    rows = Rollout.of([e.prompt_ids for e in episodes], [e.ids for e in episodes], masks=[e.mask for e in episodes],
                      rollout_logp=[e.logprobs for e in episodes],
                      advantages=[[1.0 if m else 0.0 for m in e.mask] for e in episodes])
    torch.manual_seed(0)
    policy = PolicyWorker()
    policy.engine = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                                 num_hidden_layers=1, num_attention_heads=2)).eval()
    policy.pad_id, policy.forward_micro_batch_size = tokenizer.pad_token_id, None
    policy.cfg = stage_config(rl, {"rl": {"kl_in_reward": False, "kl_coef": 0.1}})
    rows.ref_logp = rows.rollout_logp.clone()
    logp = policy.logprobs(rows)
    assert torch.equal(logp == 0, rows.mask == 0)
    seen = []
    real = rl_actors.token_logprobs

    def keep_logits(logits, labels, temperature):
        logits.retain_grad()
        seen.append((logits, labels))
        return real(logits, labels, temperature)
    monkeypatch.setattr("runtime.rl_actors.token_logprobs", keep_logits)
    loss, _ = policy.loss(rows)
    loss.backward()
    logits, _ = seen[0]
    mask = rows.tokens(policy.pad_id)["loss_mask"][:, 1:]
    start = mask.shape[1] - logits.shape[1]
    mask = mask[:, start:]
    assert logits.grad[mask.bool()].abs().sum() > 0
    assert torch.equal(logits.grad[~mask.bool()], torch.zeros_like(logits.grad[~mask.bool()]))
