"""The example environments of agentic RL (config/environments/), driven by hand as the rl stage's runner drives
them: loaded from their files, reset, then stepped with stand-ins of the model's replies (text and tool calls)."""
import importlib.util
from types import SimpleNamespace

from launcher.config import REPO_ROOT


def environment(name: str):
    """A fresh Environment of config/environments/<name>.py."""
    spec = importlib.util.spec_from_file_location(f"example_env_{name}", REPO_ROOT / "config" / "environments" /
                                                  f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Environment()


def reply(text: str = "", tool_calls: list | None = None):
    return SimpleNamespace(text=text, tool_calls=tool_calls or [])


def calculator():
    env = environment("calculator")
    first = env.reset("What is 12 + 34? Answer with the number only.", "46", seed=0)
    assert [m["role"] for m in first] == ["system", "user"] and "calc:" in first[0]["content"]
    assert first[1]["content"] == "What is 12 + 34? Answer with the number only."
    return env


def text_of(messages) -> str:
    return messages if isinstance(messages, str) else " ".join(m["content"] for m in messages)


# --- calculator ---------------------------------------------------------------------------------------------------


def test_calculator_declares_its_tool():
    [tool] = environment("calculator").tools
    assert tool["type"] == "function" and tool["function"]["name"] == "calculator"
    assert tool["function"]["parameters"]["required"] == ["expression"]


def test_calculator_text_call_returns_the_result_as_a_user_message():
    messages, reward, done = calculator().step(reply("Let me compute. calc: 12+34"))
    assert "46" in text_of(messages) and reward == 0.0 and not done
    assert isinstance(messages, str) or all(m["role"] == "user" for m in messages)
    assert "(2 + 3) * 4 - 6 / 3 = 18" in calculator().step(reply("calc: (2 + 3) * 4 - 6 / 3"))[0]
    assert "7/2" in calculator().step(reply("calc: 7 / 2"))[0]
    for text in ("`calc: 12+34`", "calc: `12+34`"):
        assert calculator().step(reply(text))[0] == "12+34 = 46"


def test_calculator_tool_call_returns_a_tool_message():
    messages, reward, done = calculator().step(
        reply('<tool_call>...</tool_call>', [{"name": "calculator", "arguments": {"expression": "12 + 34"}}]))
    assert messages == [{"role": "tool", "content": "46"}] and reward == 0.0 and not done
    [message], _, done = calculator().step(reply("", [{"name": "search", "arguments": {"query": "12 + 34"}}]))
    assert message["role"] == "tool" and message["content"].startswith("error") and not done


def test_calculator_final_answer_is_scored_against_the_label():
    messages, reward, done, info = calculator().step(reply("46"))
    assert messages == [] and reward == 1.0 and done and info == {"success": True}
    messages, reward, done, info = calculator().step(reply("The answer is 45."))
    assert messages == [] and reward == 0.0 and done and info == {"success": False}
    # the last integer is the answer: a small model restates the problem first
    assert calculator().step(reply("12 + 34 is 46."))[1:] == (1.0, True, {"success": True})
    assert calculator().step(reply("46, or 12 + 34"))[1:] == (0.0, True, {"success": False})


def test_calculator_reply_without_call_or_number_gets_feedback():
    env = calculator()
    messages, reward, done = env.step(reply("hello"))
    assert text_of(messages) == "Answer with a number, or use calc: <expression>." and reward == 0.0 and not done
    assert env.step(reply("calc: 40 + 6"))[1:] == (0.0, False)  # the episode goes on: the same task after both
    assert env.step(reply("46"))[1:] == (1.0, True, {"success": True})


def test_calculator_refuses_anything_but_arithmetic(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    unsafe = ["__import__('os')", "__import__('os').system('touch pwned')", "open('pwned', 'w')", "2 ** 1000",
              "1.5 + 1", "'a' * 3", "x + 1", "[1, 2]", "True + 1", "1 +", "1 / 0", "9" * 80]
    for expression in unsafe:
        messages, reward, done = calculator().step(reply(f"calc: {expression}"))
        assert "error" in text_of(messages) and reward == 0.0 and not done, (expression, messages)
        call = {"name": "calculator", "arguments": {"expression": expression}}
        [message], _, _ = calculator().step(reply("", [call]))
        assert message["content"].startswith("error"), (expression, message)
    assert not (tmp_path / "pwned").exists()


# --- guess the number ---------------------------------------------------------------------------------------------


def guess_game(seed: int):
    env = environment("guess_number")
    first = env.reset("What is 1 + 1? Answer with the number only.", "2", seed=seed)
    assert "1 and 100" in text_of(first) and "What is" not in text_of(first)
    return env


def test_guess_same_seed_same_secret():
    assert len({guess_game(7).secret for _ in range(4)}) == 1
    secrets = {guess_game(seed).secret for seed in range(50)}
    assert len(secrets) > 10 and all(1 <= s <= 100 for s in secrets)


def test_guess_says_higher_lower_and_ends_on_the_secret():
    env = guess_game(3)
    secret = env.secret
    if secret > 1:
        assert env.step(reply(f"{secret - 1}")) == ("Higher.", 0.0, False)
    if secret < 100:
        assert env.step(reply(f"My guess: {secret + 1}")) == ("Lower.", 0.0, False)
    assert env.step(reply("no idea")) == ("Say a number between 1 and 100.", 0.0, False)
    messages, reward, done, info = env.step(reply(f"{secret}"))
    assert messages == [] and reward == 1.0 and done and info["success"] is True


def test_guess_binary_search_wins_within_7_turns():
    for seed in range(200):
        env, low, high = guess_game(seed), 1, 100
        for _ in range(7):
            guess = (low + high) // 2
            result = env.step(reply(str(guess)))
            if result[2]:
                assert result[1] == 1.0 and result[3]["success"]
                break
            low, high = (guess + 1, high) if result[0] == "Higher." else (low, guess - 1)
        else:
            raise AssertionError(f"seed {seed}: binary search did not finish in 7 turns")
