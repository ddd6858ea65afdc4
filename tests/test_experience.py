"""The RL rollout record (runtime/experience.py): a misspelt field fails at once; row selection keeps the
(B, T) layout; values go into a model batch's response positions and back unchanged."""
import pickle

import pytest
import torch

from runtime.experience import Rollout, informative_groups
from runtime.logprobs import pad_prompt_response


def rollout() -> Rollout:
    return Rollout.of([[1, 2], [3], [4, 5, 6]], [[7, 8, 9], [10], [11, 12]], prompts=["a", "b", "c"],
                      completions=["x", "y", "z"], labels=[0, 1, None],
                      rollout_logp=[[-0.1, -0.2, -0.3], [-0.4], [-0.5, -0.6]])


def test_misspelt_field_fails():
    r = rollout()
    with pytest.raises(AttributeError):
        r.old_lgop = torch.zeros_like(r.mask)
    with pytest.raises(AttributeError):
        r.advantage  # noqa: B018


def test_layout_and_selection():
    r = rollout()
    assert len(r) == 3 and r.mask.shape == r.rollout_logp.shape == (3, 3) and r.mask.dtype == torch.float32
    assert r.mask.tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0]]
    assert r.rollout_logp[1].tolist() == [pytest.approx(-0.4), 0.0, 0.0]
    part = r[1:3]
    assert len(part) == 2 and part.mask.shape == part.rollout_logp.shape == (2, 3) and part.ref_logp is None
    assert part.response_ids == [[10], [11, 12]] and part.labels == [1, None]
    picked = r[[2, 0]]
    assert picked.prompt_ids == [[4, 5, 6], [1, 2]] and picked.completions == ["z", "x"]
    assert torch.equal(picked.rollout_logp, r.rollout_logp[[2, 0]])
    assert len(r[0:0]) == 0 and r[0:0].mask.shape == (0, 3)
    again = pickle.loads(pickle.dumps(r))  # as Ray ships it to an actor
    assert again.response_ids == r.response_ids and torch.equal(again.rollout_logp, r.rollout_logp)


def test_batch_positions_round_trip():
    """A model batch's response positions (prompt+response, right-padded) hold the record's values, in order."""
    r = rollout()
    batch = r.tokens(0)
    assert torch.equal(batch["input_ids"], pad_prompt_response(r.prompt_ids, r.response_ids, 0)["input_ids"])
    mask = batch["loss_mask"][:, 1:]
    laid = r.to_batch(r.rollout_logp, mask)
    assert laid.shape == mask.shape and laid[mask.bool()].tolist() == r.rollout_logp[r.mask.bool()].tolist()
    assert torch.equal(r.from_batch(laid, mask), r.rollout_logp)


def test_dynamic_sampling_keeps_groups_whose_scores_differ():
    """Groups of 3: all 0 (set aside), mixed (kept), all 1 (set aside), mixed with a repeat (kept)."""
    scores = [0, 0, 0, 1, 0, 1, 1, 1, 1, 0.5, 0.5, 0.2]
    assert informative_groups(scores, 3) == [1, 3]
    assert informative_groups([1.0, 1.0], 2) == [] and informative_groups([], 4) == []


def test_join_pads_to_the_widest_row():
    first, second = rollout()[0:2], Rollout.of([[9]], [[1, 2, 3, 4]], prompts=["d"], completions=["w"], labels=[2],
                                                truncated=[True], rollout_logp=[[-1.0, -1.0, -1.0, -1.0]])
    first.truncated = [False, False]
    joined = Rollout.join([first, second])
    assert len(joined) == 3 and joined.mask.shape == joined.rollout_logp.shape == (3, 4)
    assert joined.mask.tolist() == [[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]]
    assert joined.prompts == ["a", "b", "d"] and joined.truncated == [False, False, True] and joined.ref_logp is None
