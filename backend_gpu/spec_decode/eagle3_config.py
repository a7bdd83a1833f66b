"""An EAGLE-3 head's config.json as SpecForge and vLLM publish it (architecture
`LlamaForCausalLMEagle3`), read and checked against the target before anything loads.

Both the head's proposer and the target's model runner read it: the runner must know,
before it captures CUDA graphs, which layers' hidden states to keep (aux_states.py).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

ARCHITECTURE = "LlamaForCausalLMEagle3"


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """vLLM's and SpecForge's choice when the config names none: a low, a middle and a
    high layer."""
    return (2, num_layers // 2, num_layers - 3)


@dataclass(frozen=True)
class Eagle3Layout:
    directory: str
    hidden_size: int
    vocab_size: int
    draft_vocab_size: int
    aux_layers: tuple[int, ...]  # the target layers whose inputs the head reads

    @classmethod
    def read(cls, directory: str, target_config) -> Eagle3Layout:
        """The head's layout, or a ValueError that says what does not fit the target."""
        path = os.path.join(directory, "config.json")
        if not os.path.isfile(path):
            raise ValueError(f"EAGLE-3 head {directory!r} has no config.json")
        with open(path) as f:
            raw = json.load(f)
        architectures = raw.get("architectures") or []
        if ARCHITECTURE not in architectures:
            raise ValueError(
                f"EAGLE-3 head {directory!r}: architectures {architectures}, "
                f"expected [{ARCHITECTURE!r}]"
            )
        hidden, vocab = raw.get("hidden_size"), raw.get("vocab_size")
        if hidden != target_config.hidden_size:
            raise ValueError(
                f"EAGLE-3 head hidden_size {hidden} differs from the target's "
                f"{target_config.hidden_size}: the head was trained for another model"
            )
        if vocab != target_config.vocab_size:
            raise ValueError(
                f"EAGLE-3 head vocab_size {vocab} differs from the target's "
                f"{target_config.vocab_size}: the head was trained for another tokenizer"
            )
        draft_vocab = raw.get("draft_vocab_size") or vocab
        if not isinstance(draft_vocab, int) or not 0 < draft_vocab <= vocab:
            raise ValueError(f"EAGLE-3 head draft_vocab_size {draft_vocab!r} not in 1..{vocab}")
        nested = raw.get("eagle_config") or {}
        layers = raw.get("eagle_aux_hidden_state_layer_ids")
        layers = layers or nested.get("eagle_aux_hidden_state_layer_ids")
        num_layers = target_config.num_hidden_layers
        layers = tuple(layers) if layers else default_aux_layers(num_layers)
        if len(layers) != 3 or not all(isinstance(i, int) and 0 <= i < num_layers for i in layers):
            raise ValueError(
                f"EAGLE-3 head eagle_aux_hidden_state_layer_ids {list(layers)}: three "
                f"layers of the target's 0..{num_layers - 1} expected"
            )
        return cls(directory, hidden, vocab, draft_vocab, layers)


def aux_layers_of(config, target_config) -> tuple[int, ...]:
    """The target layers whose hidden states an EAGLE-3 head reads; () without one."""
    spec = config.speculative_config
    if spec is None or spec.method != "eagle3":
        return ()
    return Eagle3Layout.read(spec.model, target_config).aux_layers
