"""Unit tests of runtime/remote_reward.py against a real HTTP reward service on 127.0.0.1: batches in row order and
in flight together, the request's body and token, timeouts, refused connections and HTTP errors retried or not, and
answers refused; and check_service, the check before queueing."""
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from runtime.remote_reward import RemoteReward, RemoteRewardError, check_service
from runtime.rewards import is_remote

TOKEN = "s3cret-token-do-not-print"


class RewardHandler(BaseHTTPRequestHandler):
    """Scores each row len(completion), or does what the server's `behaviour` says (see `service`)."""

    def do_POST(self):
        state = self.server.state
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with state["lock"]:
            state["bodies"].append(body)
            state["headers"].append(dict(self.headers))
            number = len(state["bodies"])
            state["in_flight"] += 1
            state["max_in_flight"] = max(state["max_in_flight"], state["in_flight"])
        try:
            self.answer(state, body, number)
        finally:
            with state["lock"]:
                state["in_flight"] -= 1

    def answer(self, state, body, number):
        time.sleep(state["sleep"](body, number))
        if state["token"] and self.headers.get("Authorization") != f"Bearer {state['token']}":
            # echoes what it got, as a debugging service might: the client must blank the token
            return self.reply(401, f"bad token in {self.headers.get('Authorization')}".encode())
        if number <= state["fail_first"]:
            return self.reply(state["fail_status"], b"overloaded")
        if state["answer"] is not None:
            return self.reply(200, state["answer"])
        self.reply(200, json.dumps({"rewards": [len(c) for c in body["completions"]], "scores": [0.0],
                                    "extra_logs": {"x": 1}}).encode())

    def reply(self, status, data: bytes):
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:
            pass  # the client timed out and closed the connection

    def log_message(self, *args):
        pass


def start_service(**state) -> ThreadingHTTPServer:
    """A reward service on 127.0.0.1 in a daemon thread, its URL as `.url`; its `state` (defaults overridden by
    `state`) sets how it answers: sleep(body, request number) seconds, fail_first requests answered fail_status,
    answer (raw bytes) instead of scores, token required; and records the bodies and headers it got and the most
    requests it held at once."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), RewardHandler)
    server.daemon_threads = True
    server.state = {"lock": threading.Lock(), "bodies": [], "headers": [], "in_flight": 0, "max_in_flight": 0,
                    "sleep": lambda body, number: 0, "fail_first": 0, "fail_status": 500, "answer": None,
                    "token": None} | state
    server.url = f"http://127.0.0.1:{server.server_address[1]}/get_reward"
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return server


@pytest.fixture
def service():
    server = start_service()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture(autouse=True)
def no_proxy(monkeypatch):
    """Requests to 127.0.0.1 go straight to the test's service, whatever proxy the machine sets."""
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY"):
        monkeypatch.delenv(name, raising=False)


def settings(**changes) -> dict:
    return {"batch_size": 2, "concurrency": 4, "timeout": 1.0, "retries": 2, "backoff": 0.01, "token_env": None,
            **changes}


def rows(n: int):
    """n prompts, completions of lengths 1..n (so a row's score says which row it is), labels."""
    return [f"p{i}" for i in range(n)], ["x" * (i + 1) for i in range(n)], [f"l{i}" for i in range(n)]


def dead_url() -> str:
    """A URL where nothing listens: a port just taken and given back."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/get_reward"


def test_is_remote():
    assert is_remote("http://rm:5000/get_reward") and is_remote("https://rm.example.org/score")
    assert not is_remote("model") and not is_remote("rewards/length.py") and not is_remote(None)


def test_scores_come_back_in_row_order_across_batches(service):
    service.state["sleep"] = lambda body, number: 0.3 if body["prompts"][0] == "p0" else 0  # the first batch last
    reward = RemoteReward(service.url, settings(batch_size=3))
    assert reward(*rows(10)) == [float(i + 1) for i in range(10)]
    assert sorted(len(body["prompts"]) for body in service.state["bodies"]) == [1, 3, 3, 3]
    assert reward.requests == 4 and reward.retries == 0
    assert reward([], [], []) == [] and reward.requests == 4


def test_batches_are_sent_concurrently_up_to_concurrency(service):
    service.state["sleep"] = lambda body, number: 0.3
    assert RemoteReward(service.url, settings(concurrency=4))(*rows(16)) == [float(i + 1) for i in range(16)]
    assert 1 < service.state["max_in_flight"] <= 4
    service.state["max_in_flight"] = 0
    RemoteReward(service.url, settings(concurrency=1))(*rows(6))
    assert service.state["max_in_flight"] == 1


def test_request_body_and_headers(service):
    RemoteReward(service.url, settings(batch_size=4))(["Q: 1+1?", "Hi"], ["A: 2", " there"], [2, None])
    assert service.state["bodies"] == [{"query": ["Q: 1+1?A: 2", "Hi there"], "prompts": ["Q: 1+1?", "Hi"],
                                        "completions": ["A: 2", " there"], "labels": [2, None]}]
    headers = service.state["headers"][0]
    assert headers["Content-Type"] == "application/json" and "Authorization" not in headers


def test_a_bare_list_is_an_answer(service):
    service.state["answer"] = b"[0.5, -1]"
    assert RemoteReward(service.url, settings())(*rows(2)) == [0.5, -1.0]


def test_a_slow_answer_is_retried_then_succeeds(service, capsys):
    service.state["sleep"] = lambda body, number: 1.0 if number == 1 else 0
    reward = RemoteReward(service.url, settings(timeout=0.3, batch_size=4))
    assert reward(*rows(3)) == [1.0, 2.0, 3.0]
    assert reward.retries == 1 and reward.requests == 2
    assert capsys.readouterr().out == f"[reward] {service.url}: no answer within 0.3 s; retry 1/2 in 0.0 s\n"


def test_a_service_that_never_answers_in_time_fails_after_all_tries(service, capsys):
    service.state["sleep"] = lambda body, number: 1.0
    reward = RemoteReward(service.url, settings(timeout=0.2, retries=2, batch_size=4))
    with pytest.raises(RemoteRewardError, match="no answer after 3 tries") as err:
        reward(*rows(2))
    assert service.url in str(err.value) and "remote_reward.timeout = 0.2 s" in str(err.value)
    assert reward.requests == 3 and reward.retries == 2 and len(service.state["bodies"]) == 3
    assert capsys.readouterr().out.count("[reward]") == 2


def test_a_service_that_is_down_fails_naming_its_url(capsys):
    url = dead_url()
    reward = RemoteReward(url, settings(retries=1))
    with pytest.raises(RemoteRewardError, match="no answer after 2 tries.*connection refused.*is it up") as err:
        reward(*rows(2))
    assert url in str(err.value) and reward.requests == 2
    assert f"[reward] {url}: connection refused; retry 1/1" in capsys.readouterr().out


@pytest.mark.parametrize("status", [500, 503, 429])
def test_server_errors_are_retried(service, status, capsys):
    service.state.update(fail_first=2, fail_status=status)
    reward = RemoteReward(service.url, settings(retries=3, batch_size=4))
    assert reward(*rows(2)) == [1.0, 2.0]
    assert reward.requests == 3 and reward.retries == 2
    assert f"HTTP {status}" in capsys.readouterr().out


def test_a_client_error_fails_at_once(service, capsys):
    service.state.update(fail_first=100, fail_status=400)
    reward = RemoteReward(service.url, settings(retries=3))
    with pytest.raises(RemoteRewardError, match="HTTP 400.*overloaded") as err:
        reward(*rows(2))
    assert service.url in str(err.value)
    assert reward.requests == 1 and reward.retries == 0 and len(service.state["bodies"]) == 1
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("answer", [b'{"rewards": [1.0]}', b'{"rewards": [1.0, 2.0, 3.0]}', b'{"rewards": ["a", 1]}',
                                    b'{"rewards": [NaN, 1]}', b'{"rewards": [1, Infinity]}', b'{"rewards": [true, 1]}',
                                    b'{"scores": [1, 2]}', b"<html>oops</html>"])
def test_unusable_answers_are_refused_naming_the_url(service, answer):
    service.state["answer"] = answer
    reward = RemoteReward(service.url, settings())
    with pytest.raises(RemoteRewardError, match="one finite number per row") as err:
        reward(*rows(2))
    assert service.url in str(err.value) and answer.decode()[:10] in str(err.value)
    assert reward.requests == 1


def test_the_token_is_sent_as_a_bearer_token(service, monkeypatch):
    service.state["token"] = TOKEN
    monkeypatch.setenv("RM_TOKEN", TOKEN)
    assert RemoteReward(service.url, settings(token_env="RM_TOKEN"))(*rows(2)) == [1.0, 2.0]
    assert service.state["headers"][0]["Authorization"] == f"Bearer {TOKEN}"


def test_a_wrong_token_fails_without_showing_it(service, monkeypatch, capsys):
    service.state["token"] = "the-right-one"
    monkeypatch.setenv("RM_TOKEN", TOKEN)
    with pytest.raises(RemoteRewardError, match="HTTP 401.*token_env") as err:
        RemoteReward(service.url, settings(token_env="RM_TOKEN"))(*rows(2))
    assert "Bearer ***" in str(err.value) and TOKEN not in str(err.value)
    problem = check_service(service.url, settings(token_env="RM_TOKEN"), ["p"], [None])
    assert "HTTP 401" in problem and TOKEN not in problem
    assert TOKEN not in capsys.readouterr().out


@pytest.mark.parametrize("value", [None, ""])
def test_a_missing_token_variable_is_refused_naming_it(service, monkeypatch, value):
    if value is None:
        monkeypatch.delenv("RM_TOKEN", raising=False)
    else:
        monkeypatch.setenv("RM_TOKEN", value)
    with pytest.raises(RemoteRewardError, match="RM_TOKEN"):
        RemoteReward(service.url, settings(token_env="RM_TOKEN"))(*rows(2))
    assert "RM_TOKEN" in check_service(service.url, settings(token_env="RM_TOKEN"), ["p"], [None])
    assert service.state["bodies"] == []


def test_check_service_passes_a_live_service(service):
    assert check_service(service.url, settings(), ["a", "b", "c", "d", "e"], [1, 2, 3, 4, 5]) is None
    (body,) = service.state["bodies"]
    assert body["completions"] == ["42", "Yes.", "I liked this film.", "No", "42"]
    assert body["prompts"] == ["a", "b", "c", "d", "e"] and body["labels"] == [1, 2, 3, 4, 5]


def test_check_service_names_a_service_that_is_down():
    url = dead_url()
    problem = check_service(url, settings(), ["a"], [None])
    assert problem.startswith(f"nothing answers at {url}") and "remote_reward.check: false" in problem


@pytest.mark.parametrize("state, words", [({"fail_first": 1}, "HTTP 500"), ({"answer": b"[1, 2, 3]"}, "one finite"),
                                          ({"sleep": lambda body, number: 1.0}, "no answer within 0.2 s")])
def test_check_service_sends_one_request_and_says_what_went_wrong(service, state, words):
    service.state.update(state)
    problem = check_service(service.url, settings(timeout=0.2), ["a", "b"], [None, None])
    assert service.url in problem and words in problem and "start the service" in problem
    assert len(service.state["bodies"]) == 1
