"""DPO's reference log-probs, computed once before training by the policy engine (stages/dpo.py), give the losses,
metrics and held-out rewards that a frozen copy of the reference, run in every step, gives: for each loss that uses
a reference (dpo, ipo, kto), over a few DeepSpeed steps (one ZeRO-0 rank on gloo, in this process) on a tiny model.
Also: no rank holds a model besides its engine; the reference pass deals the rows to the ranks in equal shares
(ZeRO-3 needs as many forwards on each rank) and refuses to run on a policy that has been updated."""
import socket

import pytest
import torch

from launcher.config import stage_config
from runtime import models, trainer
from runtime.deepspeed_strategy import Rank
from stage_helpers import Tracker, tiny_reviews_model
from stages import dpo

RANKS = 2  # the reference pass and the held-out rewards are dealt as to two ranks (both served by the one worker)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama with a reviews tokenizer, and pairs of unequal lengths: (model dir, train, held out)."""
    base = tmp_path_factory.mktemp("dpo-reference") / "base"
    words = tiny_reviews_model(base)[:28]
    pairs = [{"id": i, "prompt": " ".join(w[:2 + i % 3]), "chosen": " ".join(w[3:9 + i % 4]),
              "rejected": " ".join(words[i + 14][3:6 + i % 5])} for i, w in enumerate(words[:14])]
    return base, pairs[:9], pairs[9:]  # 9 training pairs (batch 4: one left out per epoch), 5 held out


class InProcessGroup:
    """Stands in for the stage's ActorGroup of Ray actors: every rank's share goes to the one worker in this process,
    in turn (nothing trains in the passes dealt to two ranks); the share sizes of each call are recorded."""

    def __init__(self, worker):
        self.worker, self.share_sizes = worker, []

    def call_per_rank(self, method: str, per_rank_args: list) -> list:
        self.share_sizes.append([len(share) for share in per_rank_args])
        return [getattr(self.worker, method)(share) for share in per_rank_args]


class PerStepReference(dpo.DPOWorker):
    """DPO as it was: a frozen, unsharded copy of the reference on the rank, its forward run on every micro-batch."""

    def setup(self, cfg, rank):
        super().setup(cfg, rank)
        self.reference = models.load_causal_lm(rank.model_dir).eval()

    def compute(self, rows):
        policy, self.engine = self.engine, self.reference  # the worker's forwards, through the frozen copy
        with torch.no_grad():
            chosen, rejected, _, _ = self.pair_logps(rows)
            columns = [chosen, rejected] + ([self.mismatched_logps(rows)] if self.cfg.loss == "kto" else [])
        self.engine = policy
        return super().compute([row | dict(zip(dpo.REFERENCE_KEYS, values))
                                for row, values in zip(rows, zip(*(c.tolist() for c in columns)))])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(worker_cls, base, loss: str, steps: int):
    """One ZeRO-0 rank set up as the stage sets it up (learning rate 1e-3 so that steps visibly move the policy)."""
    cfg = stage_config(dpo, {"seed": 3, "dpo": {
        "loss": loss, "zero_stage": 0, "num_workers": 1, "epochs": 2, "batch_size": 4, "micro_batch_size": 2,
        "learning_rate": 1e-3, "warmup_steps": 0, "checkpoint_every": 0, "nll_weight": 0.1,
        "precision": "fp32"}})  # (in bf16 a batch's rows round differently at each batch composition)
    worker = worker_cls()
    worker.setup(cfg, Rank(0, {"master_addr": "127.0.0.1", "master_port": free_port(), "world_size": 1}, 1,
                           str(base), steps))
    return cfg, worker


@pytest.mark.parametrize("loss", ["dpo", "ipo", "kto"])
def test_precomputed_reference_matches_a_per_step_reference(tiny, loss):
    base, train_rows, eval_rows = tiny
    steps = 4
    runs = {}
    for name, worker_cls in (("precomputed", dpo.DPOWorker), ("per_step", PerStepReference)):
        cfg, worker = start(worker_cls, base, loss, steps)
        group = InProcessGroup(worker)
        if name == "precomputed":  # as the stage's run does it
            reference_logps = lambda rows: trainer.per_row(group, rows, RANKS, "reference_logps")
        else:  # the rows as the stage pairs them (KTO's mismatched responses), without reference log-probs
            reference_logps = lambda rows: [{} for _ in rows]
        train, held_out = (dpo.with_reference(rows, loss, reference_logps) for rows in (train_rows, eval_rows))
        log = trainer.fit(group, cfg, train, "dpo", Tracker())
        runs[name] = {"log": log, "eval": trainer.per_row(group, held_out, RANKS, "evaluate"),
                      "share_sizes": group.share_sizes}

    new, old = runs["precomputed"], runs["per_step"]
    assert len(new["log"]) == len(old["log"]) == steps
    for a, b in zip(new["log"], old["log"]):
        assert a["rows"] == b["rows"]
        # Accuracy from step 2 on: before any update every implicit reward is 0 up to rounding (the pass pads its
        # batches to other widths than the step's), and which of two such zeros is larger is rounding noise. That
        # rounding, in float32 log-probs summed over a response, reaches ~1e-6 in a reward or margin (measured
        # 1.1e-6 in step 2's margin on one machine): 1e-5 absolute, against rewards of ~1e-1 after a few steps.
        for key in ("loss", "margin", "chosen_reward", "rejected_reward") + (("accuracy",) if a["step"] > 1 else ()):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-5), (loss, a["step"], key)
    torch.testing.assert_close(torch.tensor(new["eval"]), torch.tensor(old["eval"]), rtol=1e-5, atol=1e-5)
    # Not vacuous: the first step is before any update (every implicit reward ~0), the later ones are not.
    first, last = new["log"][0], new["log"][-1]
    assert abs(first["chosen_reward"]) < 1e-5 and abs(first["rejected_reward"]) < 1e-5
    assert abs(last["chosen_reward"]) > 1e-3 and max(abs(c - r) for c, r in new["eval"]) > 1e-3
    # The reference pass and the held-out rewards: 9 and 5 rows in equal shares of 5 and 3 (one repeat each).
    assert new["share_sizes"][:2] == [[5, 5], [3, 3]] and new["share_sizes"][-1] == [3, 3]


def test_no_reference_model_and_the_pass_refuses_an_updated_policy(tiny):
    base, train_rows, _ = tiny
    cfg, worker = start(dpo.DPOWorker, base, "dpo", 1)
    assert [name for name, value in vars(worker).items() if isinstance(value, torch.nn.Module)] == ["engine"]
    rows = dpo.with_reference(train_rows[:4], "dpo", worker.reference_logps)
    assert set(rows[0]) >= {"ref_chosen_logp", "ref_rejected_logp"} and "ref_mismatched_logp" not in rows[0]
    worker.train_step([rows[:2], rows[2:]])
    with pytest.raises(RuntimeError, match="before its first update"):
        worker.reference_logps(train_rows[:2])
