"""SFT's held-out loss and the reward model's held-out metrics (stages/sft.py, stages/reward_model.py) run
forward_micro_batch_size rows (pairs) per forward, the training micro-batch where it is null, with as many forwards on
every rank (under ZeRO-3 each forward gathers the weights from all ranks), and give what one forward over all the
held-out rows gives. One ZeRO-0 rank on gloo in this process serves every rank's share in turn, on a tiny Llama."""
import socket
import statistics

import pytest
import torch

from launcher.config import stage_config
from runtime.deepspeed_strategy import Rank
from stage_helpers import tiny_reviews_model
from stages import reward_model, sft

RANKS = 2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama with a reviews tokenizer, and 5 held-out SFT rows and 5 pairs of unequal lengths."""
    base = tmp_path_factory.mktemp("held-out") / "base"
    words = tiny_reviews_model(base)[:10]
    rows = [{"prompt": " ".join(w[:2 + i % 3]), "response": " ".join(w[3:6 + 2 * i])} for i, w in enumerate(words[:5])]
    pairs = [{"prompt": " ".join(w[:2 + i % 3]), "chosen": " ".join(w[3:9 + i % 4]),
              "rejected": " ".join(words[i + 5][3:5 + i])} for i, w in enumerate(words[:5])]
    return base, rows, pairs


class CountingGroup:
    """Stands in for the stage's ActorGroup: every rank's share goes to the one worker, in turn; `forwards` has, per
    call, each rank's forward passes as their numbers of rows."""

    def __init__(self, worker):
        self.worker, self.forwards, self.seen = worker, [], []
        worker.engine.module.register_forward_hook(
            lambda module, args, kwargs, out: self.seen.append(len(kwargs["input_ids"])), with_kwargs=True)

    def call_per_rank(self, method: str, per_rank_args: list) -> list:
        results, forwards = [], []
        for share in per_rank_args:
            self.seen.clear()
            results.append(getattr(self.worker, method)(share))
            forwards.append(list(self.seen))
        self.forwards.append(forwards)
        return results


def start(stage, name: str, worker_cls, base, forward_micro_batch_size):
    """One ZeRO-0 rank of `stage` (its config block `name`) as the stage sets it up, micro-batch 1."""
    cfg = stage_config(stage, {"seed": 3, name: {
        "zero_stage": 0, "num_workers": 1, "batch_size": 2, "micro_batch_size": 1, "checkpoint_every": 0,
        "forward_micro_batch_size": forward_micro_batch_size}})
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    worker = worker_cls()
    worker.setup(cfg, Rank(0, {"master_addr": "127.0.0.1", "master_port": port, "world_size": 1}, 1, str(base), 1))
    return worker, CountingGroup(worker)


def check_forwards(group: CountingGroup, size: int) -> None:
    """Every call: each rank ran as many forwards as the others, none of more than `size` rows."""
    for forwards in group.forwards:
        assert len({len(rank) for rank in forwards}) == 1, forwards
        assert max(n for rank in forwards for n in rank) <= size, forwards


@pytest.mark.parametrize("forward_micro_batch_size", [None, 2])
def test_sft_held_out_loss_in_pieces(tiny, forward_micro_batch_size):
    base, rows, _ = tiny
    worker, group = start(sft, "sft", sft.SFTWorker, base, forward_micro_batch_size)

    def one_forward(held_out):  # all the rows in one forward, as the stage did it before
        with torch.no_grad():
            worker.engine.eval()
            nll, tokens = sft.response_nll(worker.engine, sft.tokenize_sft(worker.tokenizer, held_out))
            worker.engine.train()
        return (nll / tokens).item()

    # 5 rows: shares of 3 (one repeat) on the two ranks; 1 row: repeated on the other rank, one forward each.
    for held_out in (rows, rows[:1]):
        loss = sft.held_out_loss(group, held_out, RANKS)
        check_forwards(group, forward_micro_batch_size or 1)
        assert loss == pytest.approx(one_forward(held_out), rel=1e-5)
    assert [len(rank) for rank in group.forwards[-1]] == [1, 1]


@pytest.mark.parametrize("forward_micro_batch_size", [None, 2])
def test_reward_model_held_out_metrics_in_pieces(tiny, forward_micro_batch_size):
    base, _, pairs = tiny
    worker, group = start(reward_model, "reward_model", reward_model.RewardWorker, base, forward_micro_batch_size)
    with torch.no_grad():
        worker.engine.eval()
        chosen, rejected = reward_model.score_pairs(worker.engine, worker.tokenizer, pairs)
        worker.engine.train()
    metrics = reward_model.held_out_metrics(group, pairs, RANKS)
    check_forwards(group, 2 * (forward_micro_batch_size or 1))  # a pair is two rows, chosen and rejected
    rewards = chosen.tolist() + rejected.tolist()
    assert metrics["pairs"] == 5
    assert metrics["accuracy"] == statistics.fmean((chosen > rejected).tolist())
    assert metrics["reward_mean"] == pytest.approx(statistics.fmean(rewards), rel=1e-5, abs=1e-6)
    assert metrics["reward_std"] == pytest.approx(statistics.pstdev(rewards), rel=1e-5)
