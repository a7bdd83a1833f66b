"""studies.eagle3_score: the length walked as the engine's verifies leave the anchors
skips the positions a kept chain crossed, per sequence; the threshold stops a chain."""

from __future__ import annotations

import pytest
import torch

from studies.eagle3_score import under, walked


def test_walk_skips_what_a_kept_chain_crossed():
    accepted = torch.tensor([2, 0, 0, 1, 3, 0, 0])
    # keep 2 at 0 (next anchor 3), keep 1 at 3 (next 5), 0 at 5, 0 at 6
    assert walked(accepted, [7]) == (3 + 2 + 1 + 1) / 4
    # every position's average counts the crossed ones too
    assert (1 + accepted.float()).mean().item() == pytest.approx(13 / 7)


def test_walk_starts_each_sequence_at_its_first_anchor():
    accepted = torch.tensor([2, 0, 0, 3])
    assert walked(accepted, [4]) == (3 + 4) / 2
    assert walked(accepted, [1, 3]) == (3 + 1 + 1 + 4) / 4


def test_threshold_stops_the_chain_before_an_unsure_guess():
    ok = torch.tensor([[True, True, True], [True, False, True]])
    chance = torch.tensor([[0.9, 0.9, 0.9], [0.4, 0.9, 0.9]])
    free = under(ok, chance, 0.0, [2])
    assert free["acceptance_length"] == 1 + (3 + 1) / 2
    assert free["walked_length"] == 4  # the first chain keeps 3 and crosses the second
    # 0.85: the first chain's third guess (0.9 * 0.9 < 0.85) and the second's
    # second (0.4) are not drawn
    sure = under(ok, chance, 0.85, [2])
    assert sure["verify_rows"] == 1 + (2 + 1) / 2
    assert sure["acceptance_length"] == 1 + (2 + 1) / 2
    assert sure["walked_length"] == 3
