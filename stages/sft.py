"""Stage `sft`: supervised fine-tuning with DeepSpeed ZeRO on Ray actors; loss on response tokens only.

    .venv/bin/snakemake --profile cluster_profiles/local results/<experiment>/sft
Output: a Hugging Face `save_pretrained` directory, plus train_log.jsonl (per-step metrics) and metrics.json.
With `sft.from: <dir>` nothing is trained: the given model becomes the output (its weights linked) and the
held-out loss is measured once.
"""
import dataclasses
import json
from pathlib import Path

import torch

from runtime import data, trainer
from runtime.deepspeed_strategy import DeepSpeedWorker, Rank
from runtime.logprobs import pad_prompt_response, response_logprobs
from runtime.models import link_given_model, load_causal_lm, load_tokenizer

USES_RAY = True


@dataclasses.dataclass
class Config(trainer.TrainerConfig):
    packing: bool
    given: str | None  # the config's `from`: a model to use instead of training one

    @classmethod
    def from_params(cls, params: dict) -> "Config":
        keys = dict(params["sft"])
        given = keys.pop("from")
        return cls(**keys, given=given, seed=params["seed"])


def tokenize_sft(tokenizer, rows: list[dict], packed: bool = False) -> dict:
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
    return pad_prompt_response([encode(r["prompt"]) for r in rows], [encode(r["response"]) for r in rows],
                               tokenizer.pad_token_id, packed)


def response_nll(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed negative log-likelihood of the response tokens, and their count."""
    logp, mask = response_logprobs(model, batch)
    return -logp.sum(), mask.sum()


class SFTWorker(DeepSpeedWorker):
    def setup(self, cfg: Config, rank: Rank) -> None:
        self.init_distributed(rank.rank, rank.rendezvous, rank.num_threads)
        self.tokenizer = load_tokenizer(rank.model_dir)
        self.cfg = cfg
        self.build_engine(cfg, rank, load_causal_lm)

    def loss(self, rows):
        nll, tokens = response_nll(self.engine, tokenize_sft(self.tokenizer, rows, self.cfg.packing))
        loss = nll / tokens.clamp(min=1)
        return loss, {"loss": loss.detach()}

    @torch.no_grad()
    def evaluate(self, rows) -> list[tuple[float, float]]:
        """Each row's summed negative log-likelihood of its response tokens and their count, forward_micro_batch_size
        rows per forward (trainer.forward_pieces)."""
        self.engine.eval()
        results = []
        for piece in trainer.forward_pieces(rows, self.cfg):
            logp, mask = response_logprobs(self.engine, tokenize_sft(self.tokenizer, piece, self.cfg.packing))
            results += zip((-logp.sum(-1)).tolist(), mask.sum(-1).tolist())
        self.engine.train()
        return results


def held_out_loss(group, rows: list, world_size: int) -> float:
    """Mean negative log-likelihood per response token over the held-out rows (trainer.per_row: as many forwards on
    every rank)."""
    results = trainer.per_row(group, rows, world_size, "evaluate")
    return sum(n for n, _ in results) / max(1.0, sum(t for _, t in results))


def run(cfg: Config, inputs: dict, output: Path, tracker) -> None:
    if cfg.given:  # measured on the held-out SFT rows where the experiment has an SFT dataset
        link_given_model(inputs["given"], inputs["model"], output)
        tracker.set_tags({"alignpipe.given_model": str(inputs["given"])})
        summary = {"given": str(inputs["given"]), "steps": 0}
        if "data" in inputs:
            group = trainer.start_workers(SFTWorker, cfg, output, 0, tracker)
            eval_loss = held_out_loss(group, data.read_jsonl(inputs["data"] / "sft_eval.jsonl"), cfg.num_workers)
            group.shutdown()
            summary |= {"eval_loss_before": eval_loss, "eval_loss_after": eval_loss}
            tracker.log_metrics({"eval_loss": eval_loss})
        (output / "metrics.json").write_text(json.dumps(summary, indent=2))
        print(f"[sft] given model {inputs['given']} (not trained)"
              + (f": held-out loss {summary['eval_loss_after']:.4f}" if "data" in inputs else ""), flush=True)
        return
    train_rows = data.read_jsonl(inputs["data"] / "sft_train.jsonl")
    eval_rows = data.read_jsonl(inputs["data"] / "sft_eval.jsonl")
    total_steps = trainer.steps_for(cfg, len(train_rows), "sft")
    group = trainer.start_workers(SFTWorker, cfg, inputs["model"], total_steps, tracker)
    eval_before = held_out_loss(group, eval_rows, cfg.num_workers)
    tracker.log_metrics({"eval_loss": eval_before}, step=0)
    log = trainer.fit(group, cfg, train_rows, "sft", tracker)
    eval_after = held_out_loss(group, eval_rows, cfg.num_workers)
    tracker.log_metrics({"eval_loss": eval_after}, step=len(log))
    group.call("save_hf", str(output), str(inputs["model"]))
    group.shutdown()
    trainer.save_log(output, log)
    summary = {"steps": len(log), "final_train_loss": log[-1]["loss"], "eval_loss_before": eval_before,
               "eval_loss_after": eval_after}
    (output / "metrics.json").write_text(json.dumps(summary, indent=2))
    tracker.log_artifact(output / "metrics.json")
    print(f"[sft] held-out loss {eval_before:.4f} -> {eval_after:.4f}; model -> {output}", flush=True)
