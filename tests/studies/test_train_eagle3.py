"""studies.train_eagle3's loss: against the target's distribution over the draft
vocabulary (the default), or its choice; and its learning-rate schedule. The whole
trainer runs on the tiny Llama in tests/backend_gpu/test_spec_eagle3.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from studies.eagle3_ttt import learning_rate
from studies.train_eagle3 import step_loss


def test_the_distribution_loss_is_least_where_the_head_says_what_the_target_does():
    target = torch.randn(5, 11)
    labels = torch.tensor([3, -100, 0, 7, 2])
    logits = target.clone().requires_grad_()
    step_loss(logits, labels, target).backward()
    # at the target's own logits the cross-entropy is its entropy, a minimum
    torch.testing.assert_close(logits.grad, torch.zeros_like(target), atol=1e-6, rtol=0)
    other = (target + torch.randn(5, 11)).requires_grad_()
    assert step_loss(other, labels, target) > step_loss(target, labels, target)


def test_rows_without_a_label_are_left_out_and_a_sure_target_is_its_choice():
    labels = torch.tensor([4, -100, 1])
    sure = F.one_hot(torch.tensor([4, 9, 1]), 10).float() * 1e4  # the target all but certain
    logits = torch.randn(3, 10)
    want = F.cross_entropy(logits, labels, ignore_index=-100)
    torch.testing.assert_close(step_loss(logits, labels, sure), want)
    torch.testing.assert_close(step_loss(logits, labels), want)


def test_the_cosine_rate_falls_from_the_peak_to_nothing_and_the_constant_stays():
    rates = [learning_rate(1e-3, done, "cosine") for done in (0.0, 0.25, 0.5, 1.0, 1.5)]
    assert rates[0] == 1e-3 and rates[-2] == rates[-1] == 0.0
    assert rates[0] > rates[1] > rates[2] == 0.5e-3 > rates[3]
    assert learning_rate(1e-3, 0.7, "constant") == 1e-3


def test_the_chains_from_some_anchors_are_those_of_all_anchors_picked_out():
    from studies.eagle3_ttt import Eagle3TTT

    torch.manual_seed(0)
    cfg = {
        "hidden_size": 16,
        "intermediate_size": 24,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 4,
        "rms_norm_eps": 1e-5,
        "draft_vocab_size": 12,
    }
    head = Eagle3TTT(cfg, torch.randn(30, 16))
    ids, aux = torch.randint(0, 30, (3, 9)), torch.randn(3, 9, 48)
    rows = torch.zeros(3, 9, dtype=torch.bool)
    rows[0, 4:8] = True  # an answer's anchors
    rows[1, [0, 2, 8]] = True  # scattered, the last position among them
    every = head(ids, aux, 3)
    some = head(ids, aux, 3, rows)
    assert [s.shape for s in some] == [(7, 12)] * 3
    for e, s in zip(every, some, strict=True):
        torch.testing.assert_close(s, e[rows], atol=1e-5, rtol=1e-5)
    s.sum().backward()  # and it trains
    assert head.fc.weight.grad.abs().sum() > 0
    none = head(ids, aux, 2, torch.zeros(3, 9, dtype=torch.bool))
    assert [n.shape for n in none] == [(0, 12)] * 2
