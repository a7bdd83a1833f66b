"""Score an EAGLE-3 head offline on the prompts studies/spec_decode.py measures, at the
cost of one pass of the target over them instead of a speculative run per setting.

    python -m studies.eagle3_score --model smollm2-135m-instruct --head HEAD \
        --sets chat code --k 3 --confidence 0.2 0.5

The target answers the measured prompts as spec_decode asks it (greedy, ignore_eos,
--max-tokens); its hidden states over them feed the head's training-time-test forward
(studies/eagle3_ttt.py, the engine's chain step for step: tests/backend_gpu/
test_spec_eagle3.py), which at every answer position guesses a chain of k. A guess is
right when it is the target's own choice (one outside the draft vocabulary never is).
Per set and per draft_confidence_threshold (0: none), with the engine's rule (guess
j + 1 is drawn only while the head's probability of guesses 1..j is at least the
threshold): the acceptance length (1 + the guesses right before the first wrong one)
and the rows a verifying step scores (1 + the guesses), both averaged over every
answer position; and the length walked as the engine's verifies leave the anchors
(after a chain that keeps a guesses, the next is a + 1 positions on), which is what
the engine reports at temperature 0 (every position's average reads high where long
chains cross the easy stretches). Neither needs an engine per setting or a timing.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from safetensors.torch import load_file

from bench.options import DefaultsHelpFormatter
from studies.eagle3_ttt import Eagle3TTT
from studies.spec_decode import prompt_ids
from studies.train_eagle3 import features, generate, resolve


def chains(head: Eagle3TTT, ids: list[int], aux, choice, first: int, to_draft, k: int):
    """At each answer anchor with k targets in the sequence: whether each of the k
    guesses is the target's choice [N, k] and the head's probability of it [N, k]."""
    t = len(ids)
    anchors = torch.zeros(t, dtype=torch.bool)
    anchors[max(0, first - 1) : t - k] = True  # the first chain is proposed at first - 1
    if not anchors.any():
        return torch.zeros(0, k, dtype=torch.bool), torch.zeros(0, k)
    with torch.no_grad():
        logits = head(torch.tensor([ids]), aux[None], k, anchors[None])
    want = to_draft[choice]  # -1: outside the draft vocabulary
    idx = anchors.nonzero()[:, 0]
    ok, chance = [], []
    for j, lg in enumerate(logits):
        best, guess = lg.float().log_softmax(-1).max(-1)
        ok.append(guess == want[idx + j + 1])
        chance.append(best.exp())
    return torch.stack(ok, -1), torch.stack(chance, -1)


def walked(accepted: torch.Tensor, sizes: list[int]) -> float:
    """The acceptance length the engine would see: each sequence's anchors walked as
    its verifies leave them (after a chain that keeps a guesses, the next anchor is
    a + 1 positions on), rather than averaged over every position."""
    lengths = []
    for part in accepted.split(sizes):
        p = 0
        while p < len(part):
            lengths.append(1 + int(part[p]))
            p += lengths[-1]
    return sum(lengths) / max(len(lengths), 1)


def under(ok: torch.Tensor, chance: torch.Tensor, threshold: float, sizes: list[int]) -> dict:
    """Acceptance length and verify rows when guess j + 1 is drawn only while the
    cumulative probability of guesses 1..j is at least `threshold` (`sizes`: each
    sequence's anchors, in order, for the engine's walk)."""
    k = ok.shape[1]
    sure = chance.cumprod(-1)
    drawn = torch.ones_like(ok)
    drawn[:, 1:] = sure[:, : k - 1] >= threshold
    drawn = drawn.cumprod(-1).bool()
    accepted = (ok & drawn).int().cumprod(-1).sum(-1)
    return {
        "acceptance_length": round(1 + accepted.float().mean().item(), 3),
        "walked_length": round(walked(accepted, sizes), 3),
        "verify_rows": round(1 + drawn.sum(-1).float().mean().item(), 3),
        "accuracy": [round(x, 3) for x in ok.float().mean(0).tolist()],
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter
    )
    p.add_argument("--model", default="smollm2-135m-instruct", help="a packaged name or a path")
    p.add_argument("--head", required=True, help="the head's directory")
    p.add_argument("--sets", nargs="+", default=["chat", "code"], choices=["copy", "chat", "code"])
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--confidence", nargs="+", type=float, default=[0.2, 0.5])
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--bf16", action="store_true", help="the target's states in bfloat16 (AMX)")
    p.add_argument("--answers", help="JSON file caching the target's answers (train_eagle3's)")
    p.add_argument("--save-result", help="write the figures to this JSON file")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    path, hf_dir = resolve(args.model)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    with open(os.path.join(args.head, "config.json")) as f:
        cfg = json.load(f)
    layers = (
        cfg.get("eagle_aux_hidden_state_layer_ids")
        or cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    )
    sets = {name: prompt_ids(tokenizer, name) for name in args.sets}
    flat = [ids for ids in sets.values() for ids in ids]
    seqs = generate(path, flat, args.max_tokens, args.answers, ignore_eos=True)
    aux, choice, embed, *_ = features(hf_dir, seqs, layers, args.bf16)
    stored = load_file(os.path.join(args.head, "model.safetensors"))
    head = Eagle3TTT(cfg, embed)
    head.load_state_dict({k: v for k, v in stored.items() if k not in ("d2t", "t2d")})
    head.eval()
    draft_ids = torch.arange(len(stored["d2t"])) + stored["d2t"]
    to_draft = torch.full((cfg["vocab_size"],), -1, dtype=torch.long)
    to_draft[draft_ids] = torch.arange(len(draft_ids))
    result: dict = {"head": args.head, "k": args.k, "max_tokens": args.max_tokens, "sets": {}}
    # the answers' tokens the head can propose at all: a cap on every step's accuracy
    result["in_draft_vocabulary"] = {}
    start = 0
    for name, prompts in sets.items():
        oks, chances, targets = [], [], []
        for i, ids in enumerate(prompts, start):
            ok, chance = chains(head, seqs[i], aux[i], choice[i], len(ids), to_draft, args.k)
            oks.append(ok)
            chances.append(chance)
            targets.append(to_draft[choice[i][len(ids) :]])
        start += len(prompts)
        ok, chance = torch.cat(oks), torch.cat(chances)
        sizes = [len(o) for o in oks]
        rows = {f"{t:g}": under(ok, chance, t, sizes) for t in [0.0, *args.confidence]}
        result["sets"][name] = rows
        inside = round((torch.cat(targets) >= 0).float().mean().item(), 3)
        result["in_draft_vocabulary"][name] = inside
        print(f"{name}: {inside:.3f} of the answers' tokens in the draft vocabulary")
        for t, r in rows.items():
            print(
                f"{name} k={args.k} threshold {t}: acceptance length {r['acceptance_length']:.2f}"
                f" (walked as the engine's verifies leave it: {r['walked_length']:.2f})"
                f", verify rows {r['verify_rows']:.2f}, accuracy by step {r['accuracy']}"
            )
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
