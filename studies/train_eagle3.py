"""Train an EAGLE-3 head for a model on this CPU, from text the project ships, and
write it in the published layout (no head can be downloaded here).

    python -m studies.train_eagle3 --model smollm2-135m-instruct --out heads/smollm2
    python -m studies.train_eagle3 --model gemma-3-270m --out heads/gemma3

1. Prompts from text the project ships (studies/eagle3_corpus.py): for an instruct
   model, chat questions (the ShareGPT sample's, written ones, the docs' paragraphs to
   explain) and code edits (the project's functions) in its chat template; for a base
   model, the docs' paragraphs' start to continue.
2. The target answers them (greedy, the engine): the head learns what the target says.
3. The target (transformers, on the same files the engine reads) gives its hidden
   states at the three layers the head reads and its choice at every position.
4. The head (studies/eagle3_ttt.py) trains with the training-time test for a bounded
   time, its loss over the answers' positions (where the engine proposes): by default
   the cross-entropy against the target's whole distribution over the draft vocabulary
   (its final hidden state through its own lm_head, as SpecForge trains), which says
   more per position than its choice alone (`--loss choice`) when answers are few;
   lm_head and norm start from the target's own, over the draft vocabulary (the
   target's most frequent choices). Progress is printed; loss and the step-by-step
   accuracy on held-out answers (the acceptance length it implies at k = 3) go to
   --save-result.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import time
from typing import NamedTuple

import torch
import torch.nn.functional as F

from backend_gpu.spec_decode.eagle3_config import default_aux_layers
from bench.options import DefaultsHelpFormatter
from studies.eagle3_corpus import more_chat, prompts
from studies.eagle3_ttt import Eagle3TTT, head_config, learning_rate, save_head
from studies.spec_decode import QUESTIONS

POOL = 1536  # prompts made before the --prompts that fit are taken


def generate(
    path: str,
    prompt_ids: list[list[int]],
    max_tokens: int,
    cache: str | None = None,
    ignore_eos: bool = False,
) -> list[list[int]]:
    """The prompts with the target's greedy answers, 128 prompts a call (progress, and
    with `cache` a JSON file of the answers so far: a run stopped or repeated with the
    same prompts and --max-tokens generates only what it lacks)."""
    from backend_gpu import LLM, SamplingParams

    done: dict[str, list[int]] = {}
    if cache and os.path.exists(cache):
        with open(cache) as f:
            done = json.load(f)
    key = lambda ids: f"{max_tokens}{'e' * ignore_eos}:" + ",".join(map(str, ids))  # noqa: E731
    todo = [ids for ids in prompt_ids if key(ids) not in done]
    start = time.perf_counter()
    if todo:
        # wide batches: on a CPU a decode step reads the weights once for every sequence
        llm = LLM(path, max_num_seqs=64, max_model_len=1024)
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos)
        for i in range(0, len(todo), 128):
            group = todo[i : i + 128]
            for ids, out in zip(group, llm.generate(group, params), strict=True):
                done[key(ids)] = out.token_ids
            print(f"  answered {i + len(group)}/{len(todo)} ({time.perf_counter() - start:.0f} s)")
            if cache:
                with open(cache, "w") as f:
                    json.dump(done, f)
    return [ids + done[key(ids)] for ids in prompt_ids]


class Features(NamedTuple):
    """What the target gives the trainer (per sequence: aux, choice, final)."""

    aux: list[torch.Tensor]  # its hidden states at the head's layers (their inputs) [T, 3H]
    choice: list[torch.Tensor]  # its greedy choice at every position [T]
    embed: torch.Tensor  # its input embedding (the head reads it, frozen)
    lm_head: torch.Tensor
    norm: torch.Tensor  # its final norm's weight
    config: object
    final: list[torch.Tensor]  # its last hidden state after the final norm [T, H]


@torch.inference_mode()
def features(hf_dir: str, seqs: list[list[int]], layers: list[int], bf16: bool = False) -> Features:
    """The target's hidden states at `layers`, its choice and its final (normed) hidden
    state at every position of each sequence; its input embedding, lm_head and final
    norm (the head starts from them). With `bf16` the target runs under bfloat16
    autocast (as an engine serving it in bfloat16 computes) and its states are kept as
    float32."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    # the converted GGUF's files are named as the engine writes them: read them here
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(hf_dir))
    state = {}
    for path in sorted(glob.glob(f"{hf_dir}/*.safetensors")):
        state.update(load_file(path))
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    model.float().eval()
    aux: list[torch.Tensor] = [torch.empty(0)] * len(seqs)
    choice: list[torch.Tensor] = [torch.empty(0)] * len(seqs)
    final: list[torch.Tensor] = [torch.empty(0)] * len(seqs)
    normed: list[torch.Tensor] = []  # what the lm_head reads, whatever hidden_states holds
    hook = model.model.norm.register_forward_hook(lambda _m, _a, out: normed.append(out))
    start = time.perf_counter()
    # 8 sequences of like length a pass, padded at the end: causal attention keeps
    # the padding out of every real position
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    for n in range(0, len(order), 8):
        group = order[n : n + 8]
        ids = pad([torch.tensor(seqs[i]) for i in group], 0)
        normed.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = model(ids, output_hidden_states=True)
        for row, i in enumerate(group):
            t = len(seqs[i])
            aux[i] = torch.cat([out.hidden_states[j][row, :t] for j in layers], dim=-1).float()
            choice[i] = out.logits[row, :t].argmax(-1)
            final[i] = normed[-1][row, :t].to(torch.float32, copy=True)  # not a batch's view
        if (n // 8 + 1) % 8 == 0 or n + 8 >= len(order):
            done = min(n + 8, len(order))
            print(f"  target features {done}/{len(seqs)} ({time.perf_counter() - start:.0f} s)")
    hook.remove()
    norm = model.model.norm.weight.detach().float().clone()
    if model.config.model_type.startswith("gemma"):  # Gemma stores w - 1
        norm += 1
    embed = model.get_input_embeddings().weight.detach().float().clone()
    lm_head = model.get_output_embeddings().weight.detach().float().clone()
    return Features(aux, choice, embed, lm_head, norm, model.config, final)


def batches(n: int, size: int, seed: int):
    rng = random.Random(seed)
    while True:
        order = list(range(n))
        rng.shuffle(order)
        for i in range(0, n - size + 1, size):
            yield order[i : i + size]


def pad(rows: list[torch.Tensor], value) -> torch.Tensor:
    t = max(r.shape[0] for r in rows)
    return torch.stack(
        [F.pad(r, (0, 0) * (r.dim() - 1) + (0, t - r.shape[0]), value=value) for r in rows]
    )


def labels_of(
    choice: list[torch.Tensor], to_draft: torch.Tensor, steps: int, answers: list[int]
) -> list[torch.Tensor]:
    """Per sequence [T, steps]: the draft id of the target's choice at t + j + 1, -100
    where there is none, where the draft vocabulary lacks it, and at anchors t before
    the answer's first proposal (answers[i]: the index of the first answer token; the
    engine's first chain is proposed once it is sampled, at anchor answers[i] - 1)."""
    out = []
    for c, first in zip(choice, answers, strict=True):
        d = to_draft[c]
        lab = torch.full((c.shape[0], steps), -100, dtype=torch.long)
        for j in range(steps):
            lab[: max(0, c.shape[0] - j - 1), j] = d[j + 1 :]
        lab[: max(0, first - 1)] = -100
        out.append(lab)
    return out


def step_loss(logits, labels, target=None) -> torch.Tensor:
    """A chain step's loss at the rows with a label (-100: none): cross-entropy against
    the target's choice, or, given `target` (the target's logits over the draft
    vocabulary at the same rows), against its whole distribution there (more to learn
    from each position than its top choice alone)."""
    if target is None:
        return F.cross_entropy(logits, labels, ignore_index=-100)
    keep = labels >= 0
    p = target[keep].softmax(-1)
    return -(p * logits[keep].log_softmax(-1)).sum(-1).mean()


def train(head: Eagle3TTT, seqs, aux, labels, scored, args, checkpoint, teacher=None) -> list[dict]:
    """Trains on `labels` until the budget or --max-steps, scores the held-out
    sequences' `scored` labels; at every evaluation `checkpoint(curve)` writes the head
    as it is (a long run stopped early leaves its last one). With `teacher` (per
    sequence the target's final hidden states, and its lm_head over the draft
    vocabulary), the loss is against the target's distribution, else its choice. With
    --bf16 the forward passes run under bfloat16 autocast (the weights and the
    optimizer stay float32)."""
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=0.0)
    curve: list[dict] = []
    start = time.perf_counter()
    held = list(range(min(args.held_out, len(seqs) // 4)))  # scored, never trained on
    train_ids = [i for i in range(len(seqs)) if i not in held]
    for step, pick in enumerate(batches(len(train_ids), min(args.batch, len(train_ids)), 0), 1):
        idx = [train_ids[i] for i in pick]
        ids = pad([torch.tensor(seqs[i]) for i in idx], 0)
        lab = pad([labels[i] for i in idx], -100)
        rows = (lab >= 0).any(-1)  # the LM head only where a step has a label
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            logits = head(ids, pad([aux[i] for i in idx], 0.0), args.ttt_steps, rows)
            lab = lab[rows]
            targets: list = [None] * len(logits)
            if teacher is not None:
                final, readout = teacher
                f = pad([final[i] for i in idx], 0.0)  # step j's target: position t + j + 1
                targets = [f.roll(-(j + 1), 1)[rows] @ readout.T for j in range(len(logits))]
            loss = sum(
                0.8**j * step_loss(lg.float(), lab[:, j], tg if tg is None else tg.float())
                for j, (lg, tg) in enumerate(zip(logits, targets, strict=True))
            )
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        elapsed = time.perf_counter() - start
        done_share = step / args.max_steps if args.max_steps else elapsed / args.budget_s
        for group in opt.param_groups:
            group["lr"] = learning_rate(args.lr, done_share, args.schedule)
        opt.step()
        done = elapsed >= args.budget_s or (args.max_steps and step >= args.max_steps)
        if step % args.eval_every == 0 or done:
            point = {"step": step, "seconds": round(elapsed, 1), "loss": float(loss.detach())}
            point.update(evaluate(head, seqs, aux, scored, held, args.ttt_steps))
            curve.append(point)
            print(
                f"  step {step} {elapsed:.0f}/{args.budget_s} s loss {point['loss']:.3f} "
                f"held-out accuracy by step {point['accuracy']} "
                f"acceptance length at k=3 {point['acceptance_length']:.2f}"
            )
            checkpoint(curve)
        if done:
            return curve
    return curve


@torch.no_grad()
def evaluate(head, seqs, aux, labels, held: list[int], steps: int) -> dict:
    """On the held-out sequences' answers: each step's top-1 accuracy and the
    acceptance length a chain of 3 would have (1 + P(first right) + P(first two
    right) + ...), over the anchors where all steps have a label."""
    right, chains, total = [0] * steps, [0] * steps, 0
    for i in held:
        valid = (labels[i] >= 0).all(-1)
        logits = head(torch.tensor([seqs[i]]), aux[i][None], steps, valid[None])
        lab = labels[i][valid]
        ok = torch.stack([lg.argmax(-1) == lab[:, j] for j, lg in enumerate(logits)], -1)
        total += ok.shape[0]
        chain = ok.cumprod(-1)
        for j in range(steps):
            right[j] += int(ok[:, j].sum())
            chains[j] += int(chain[:, j].sum())
    total = max(total, 1)
    return {
        "accuracy": [round(r / total, 3) for r in right],
        "acceptance_length": 1 + sum(c / total for c in chains[:3]),
    }


def resolve(name: str) -> tuple[str, str]:
    """(the engine's path, the HF directory transformers reads) of a model name or path."""
    from backend_gpu.gguf_loader import convert_gguf
    from gateway.backends.default_model import DEFAULT_MODEL_ID, default_model_path, model_path

    path = str(default_model_path()) if name == DEFAULT_MODEL_ID else model_path(name)
    return path, convert_gguf(path) if path.endswith(".gguf") else path


def draft_vocabulary(
    choice: list[torch.Tensor], vocab: int, size: int, rest: list[torch.Tensor] = ()
) -> torch.Tensor:
    """The target's `size` most frequent choices (in its answers), ascending
    (SpecForge's rule); when its answers hold fewer distinct tokens than that, the
    places left go to the most frequent of `rest` (its choices over the prompts: the
    words and names an answer copies from a prompt), not to unseen ids."""
    counts = torch.bincount(torch.cat(choice), minlength=vocab).double()
    if len(rest):
        more = torch.bincount(torch.cat(list(rest)), minlength=vocab).double()
        counts = counts * (more.sum() + 1) + more  # the answers first, then the rest
    size = min(size, vocab)
    return counts.topk(size).indices.sort().values


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for r in results:
        seconds = [p["seconds"] for p in r["curve"]]
        ax1.plot(seconds, [p["loss"] for p in r["curve"]], marker="o", label=r["model"])
        lengths = [p["acceptance_length"] for p in r["curve"]]
        ax2.plot(seconds, lengths, marker="o", label=r["model"])
    ax1.set(xlabel="training seconds (CPU)", ylabel="TTT loss (3 steps)", title="loss")
    ax2.set(xlabel="training seconds (CPU)", ylabel="tokens per step at k=3")
    ax2.set_title("held-out acceptance length")
    ax2.axhline(1.8, color="grey", linestyle=":", label="goal 1.8")
    for ax in (ax1, ax2):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter
    )
    p.add_argument("--model", default="smollm2-135m-instruct", help="a packaged name or a path")
    p.add_argument("--out", required=True, help="directory the head is written to")
    p.add_argument("--prompts", type=int, default=96)
    p.add_argument("--extra-chat", type=int, default=0, help="chat prompts added to --prompts' mix")
    p.add_argument("--max-tokens", type=int, default=96, help="tokens of each generated answer")
    p.add_argument("--max-prompt", type=int, default=160, help="longest prompt kept (tokens)")
    p.add_argument("--draft-vocab", type=int, default=4096)
    p.add_argument("--ttt-steps", type=int, default=3, help="training-time-test steps")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument(
        "--schedule",
        choices=["constant", "cosine"],
        default="constant",
        help="the rate over the run (--max-steps, else --budget-s): fixed, or down to 0",
    )
    p.add_argument("--budget-s", type=float, default=300, help="training seconds")
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many (0: budget)")
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--held-out", type=int, default=8, help="sequences scored, not trained on")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--prompt-loss", action="store_true", help="train on the prompts' positions too")
    p.add_argument(
        "--bf16",
        action="store_true",
        help="the target's features and the head's passes under bfloat16 autocast (AMX)",
    )
    p.add_argument(
        "--loss",
        choices=["distill", "choice"],
        default="distill",
        help="against the target's distribution over the draft vocabulary, or its choice",
    )
    p.add_argument("--answers", help="JSON file caching the target's answers (read, extended)")
    p.add_argument(
        "--answers-only",
        action="store_true",
        help="stop once the --answers cache holds the answers (train in a later run)",
    )
    p.add_argument("--save-result", help="append this run's figures to this JSON file")
    p.add_argument("--plot", help="write the loss and acceptance curves of --save-result here")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    began = time.perf_counter()
    path, hf_dir = resolve(args.model)
    from transformers import AutoConfig, AutoTokenizer

    target_config = AutoConfig.from_pretrained(hf_dir)
    target_config = getattr(target_config, "text_config", None) or target_config
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    # vLLM's default layers, kept inside a model of fewer than 6 layers
    num_layers = target_config.num_hidden_layers
    layers = [min(max(i, 0), num_layers - 1) for i in default_aux_layers(num_layers)]
    # prompts that leave room for the answer; short ones: the target's passes over the
    # prompts are most of the time before training on a CPU
    limit = min(target_config.max_position_embeddings - args.max_tokens, args.max_prompt)
    # drawn from a pool of one size, so that the first N are the same prompts whatever
    # --prompts is (up to about 700): the --answers cache serves a shorter run
    pool = max(2 * args.prompts, POOL)
    made = prompts(tokenizer, pool, QUESTIONS)
    kept = [i for i, ids in enumerate(made) if len(ids) <= limit][: args.prompts]
    prompt_ids = [made[i] for i in kept]
    if args.extra_chat:  # after the others: the first --prompts stay as they were
        taken = kept[-1] + 1 if kept else 0
        extra = more_chat(tokenizer, pool, QUESTIONS, taken, 2 * args.extra_chat)
        prompt_ids += [ids for ids in extra if len(ids) <= limit][: args.extra_chat]
    print(f"[{time.perf_counter() - began:.0f} s] {len(prompt_ids)} prompts; the target answers")
    seqs = generate(path, prompt_ids, args.max_tokens, args.answers)
    if args.answers_only:
        print(f"[{time.perf_counter() - began:.0f} s] {len(seqs)} answers in {args.answers}")
        return {"model": args.model, "sequences": len(seqs), "tokens": sum(map(len, seqs))}
    print(f"[{time.perf_counter() - began:.0f} s] {sum(map(len, seqs))} tokens; target features")
    aux, choice, embed, lm_head, norm, _, final = features(hf_dir, seqs, layers, args.bf16)
    answers = [len(ids) for ids in prompt_ids]
    answered = [c[first - 1 :] for c, first in zip(choice, answers, strict=True)]
    draft_ids = draft_vocabulary(answered, target_config.vocab_size, args.draft_vocab, choice)
    to_draft = torch.full((target_config.vocab_size,), -100, dtype=torch.long)
    to_draft[draft_ids] = torch.arange(len(draft_ids))
    labels = labels_of(choice, to_draft, args.ttt_steps, answers)
    # the prompts' positions too: the target's choices over text it did not write,
    # more to learn from at no cost of generation (scored on the answers alone)
    taught = labels_of(choice, to_draft, args.ttt_steps, [1] * len(seqs))
    cfg = head_config(target_config, len(draft_ids), layers, nested=True)
    head = Eagle3TTT(cfg, embed)
    with torch.no_grad():  # start from the target's own output layer
        head.lm_head.weight.copy_(lm_head[draft_ids])
        head.norm.weight.copy_(norm)
    print(f"[{time.perf_counter() - began:.0f} s] training for {args.budget_s:.0f} s")

    def checkpoint(curve: list[dict]) -> None:
        save_head(args.out, head, draft_ids, target_config.vocab_size)
        with open(os.path.join(args.out, "curve.json"), "w") as f:
            json.dump(curve, f, indent=1)

    teacher = (final, lm_head[draft_ids]) if args.loss == "distill" else None
    taught = taught if args.prompt_loss else labels
    curve = train(head, seqs, aux, taught, labels, args, checkpoint, teacher)
    result = {
        "model": args.model,
        "head": args.out,
        "tokens": sum(map(len, seqs)),
        "sequences": len(seqs),
        "draft_vocab_size": len(draft_ids),
        "aux_layers": layers,
        "ttt_steps": args.ttt_steps,
        "loss": args.loss,
        "schedule": args.schedule,
        "bf16": args.bf16,
        "curve": curve,
        "wall_s": round(time.perf_counter() - began, 1),
    }
    print(f"[{result['wall_s']:.0f} s] head written to {args.out}")
    if args.save_result:
        try:
            with open(args.save_result) as f:
                runs = [r for r in json.load(f) if r["model"] != args.model]
        except FileNotFoundError:
            runs = []
        runs.append(result)
        with open(args.save_result, "w") as f:
            json.dump(runs, f, indent=2)
        if args.plot:
            plot(runs, args.plot)
    return result


if __name__ == "__main__":
    main()
