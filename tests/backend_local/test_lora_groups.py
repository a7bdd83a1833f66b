"""The llama.cpp engine's LoRA scheduling and cache keys, without a model."""

import pytest

from backend_local import EngineConfig
from backend_local.lora_groups import GroupTurns
from backend_local.prefix_blocks import BLOCK_SIZE, block_hashes
from backend_local.slots import Slot, place
from engine_api.records import AdapterRef

A, B = ("a", "/a.gguf"), ("b", "/b.gguf")


def test_groups_take_turns_round_robin_in_the_order_they_came():
    turns = GroupTurns()
    assert [turns.pick([None, A, B]) for _ in range(4)] == [None, A, B, None]
    assert turns.pick([A]) == A  # a group alone decodes every step
    assert turns.pick([A]) == A


def test_a_new_group_waits_for_its_turn_and_a_gone_one_is_skipped():
    turns = GroupTurns()
    assert turns.pick([None, A]) == None  # noqa: E711 (None is the base model's group)
    assert turns.pick([None, A, B]) == A
    assert turns.pick([None, A, B]) == B
    assert turns.pick([A, B]) == A  # the base model's requests ended: the next after it
    assert turns.pick([B]) == B


def test_cells_are_never_reused_under_another_adapter():
    ref_a, ref_b = AdapterRef(*A), AdapterRef(*B)
    slots = [Slot(0, [1, 2, 3, 4], "t", 1.0, adapter=ref_a), Slot(1, [], None, 0.0)]
    assert place(slots, [1, 2, 3, 4, 5], "t", adapter=ref_b).reuse == 0
    assert place(slots, [1, 2, 3, 4, 5], "t").reuse == 0  # nor under the base model
    p = place(slots, [1, 2, 3, 4, 5], "t", adapter=AdapterRef(*A))
    assert (p.source, p.reuse) == (slots[0], 4)


def test_block_hashes_differ_by_adapter_published_blocks_too():
    tokens = list(range(2 * BLOCK_SIZE))
    base = block_hashes(tokens, None, len(tokens))
    under_a = block_hashes(tokens, "t1", len(tokens), AdapterRef(*A))
    assert under_a == block_hashes(tokens, "t2", len(tokens), AdapterRef(*A))
    assert not set(under_a) & set(base)
    assert not set(under_a) & set(block_hashes(tokens, "t1", len(tokens), AdapterRef(*B)))


def test_lora_settings_are_checked():
    with pytest.raises(ValueError, match="max_loras"):
        EngineConfig("m.gguf", max_loras=0)
    with pytest.raises(ValueError, match="embedding engine"):
        EngineConfig("m.gguf", task="embed", enable_lora=True)
