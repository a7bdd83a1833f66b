"""studies.eagle3_corpus: the extra chat prompts (train_eagle3 --extra-chat) are chat,
none of them among the alternating mix's, and asking for them leaves the mix as it was."""

from __future__ import annotations

from studies.eagle3_corpus import more_chat, prompts
from studies.spec_decode import QUESTIONS


class Characters:
    """A tokenizer with a chat template: the user's text, a character a token."""

    chat_template = "{{ messages }}"

    def apply_chat_template(self, turn, add_generation_prompt, tokenize):
        return turn[0]["content"]

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


def test_extra_chat_prompts_are_chat_and_new_to_the_mix():
    tok = Characters()
    pool = prompts(tok, 128, QUESTIONS)
    mix = pool[:64]  # the trainer takes the pool's first
    extra = more_chat(tok, 128, QUESTIONS, 64, 40)
    assert prompts(tok, 128, QUESTIONS) == pool
    assert len(extra) == 40
    text = lambda ids: "".join(map(chr, ids))  # noqa: E731
    assert not any("```python" in text(ids) for ids in extra)  # no code edit
    assert sum("```python" in text(ids) for ids in mix) == 32  # the mix alternates
    assert not {tuple(ids) for ids in extra} & {tuple(ids) for ids in mix}
    # the pool's chat prompts after the first 64 are the extras' first
    assert [ids for ids in pool[64:] if "```python" not in text(ids)][:20] == extra[:20]
