from backend_local.requests import Request
from backend_local.slots import Slot, common_prefix_len, place, runs
from engine_api.sampling import SamplingParams


def busy(slot: Slot) -> Slot:
    slot.request = Request("r", [1], SamplingParams(), None, lambda _: None)
    return slot


def test_common_prefix_len():
    assert common_prefix_len([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_len([1, 2], [1, 2, 3]) == 2
    assert common_prefix_len([], [1]) == 0


def test_free_slot_with_the_prefix_is_reused_in_place():
    slots = [Slot(0, [9, 9], "a", 5.0), Slot(1, [1, 2, 3, 4], "a", 1.0)]
    p = place(slots, [1, 2, 3, 7, 8], "a")
    assert (p.slot.seq_id, p.source.seq_id, p.reuse) == (1, 1, 3)


def test_other_salt_never_shares_cells():
    slots = [Slot(0, [1, 2, 3, 4], "tenant-a", 1.0), Slot(1, [], None, 0.0)]
    p = place(slots, [1, 2, 3, 4, 5], "tenant-b")
    assert p.source is None and p.reuse == 0
    assert p.slot.seq_id == 1  # the empty slot, keeping tenant-a's cache


def test_prefix_of_a_busy_slot_is_copied_to_a_free_one():
    slots = [busy(Slot(0, [1, 2, 3, 4], "a")), Slot(1, [7], "a", 2.0), Slot(2, [8], "a", 1.0)]
    p = place(slots, [1, 2, 3, 9], "a")
    assert (p.slot.seq_id, p.source.seq_id, p.reuse) == (1, 0, 3)  # busy ids stay contiguous
    slots = [Slot(0, [7], "a", 2.0), Slot(1, [8], "a", 1.0), busy(Slot(2, [1, 2, 3, 4], "a"))]
    p = place(slots, [1, 2, 3, 9], "a")
    assert (p.slot.seq_id, p.source.seq_id, p.reuse) == (1, 2, 3)  # either side: the LRU


def test_the_slot_that_keeps_busy_ids_contiguous_wins_over_an_empty_or_cached_one():
    slots = [busy(Slot(i, [1, i])) for i in range(4)] + [Slot(4), Slot(5, [5, 6, 7], "a")]
    slots[2] = Slot(2, [9, 9], "b", 5.0)  # a gap among the busy ones, recently used
    p = place(slots, [5, 6, 7, 8], "a")
    # slot 5 holds the prefix and slot 4 is empty, but either would leave the gap
    assert (p.slot.seq_id, p.source.seq_id, p.reuse) == (2, 5, 3)
    assert runs({0, 1, 3}) == 2 and runs({0, 1, 2, 3}) == 1 and runs(set()) == 0


def test_last_prompt_token_is_always_recomputed():
    slots = [Slot(0, [1, 2, 3], None, 1.0)]
    p = place(slots, [1, 2, 3], None)
    assert p.reuse == 2
    p = place([Slot(0, [1], None, 1.0)], [1], None)
    assert p.reuse == 0 and p.source is None


def test_published_prefix_is_shared_across_salts_but_tenant_tokens_are_not():
    # tenant a's slot: 4 published tokens, then its own tokens 5, 6
    slots = [Slot(0, [1, 2, 3, 4, 5, 6], "a", 1.0, shared_len=4), Slot(1)]
    p = place(slots, [1, 2, 3, 4, 5, 6, 7], "b", shared_prefix_len=4)
    assert (p.source.seq_id, p.reuse) == (0, 4)  # not 6: tokens 5, 6 are a's
    assert p.slot.seq_id == 1  # copied to the empty slot: a keeps its own tokens cached
    p = place(slots, [1, 2, 3, 4, 5, 6, 7], "b", shared_prefix_len=2)
    assert p.reuse == 2  # only what both requests mark as published
    p = place(slots, [1, 2, 3, 4, 5, 6, 7], "b")
    assert p.source is None and p.reuse == 0  # b does not mark it shared: nothing
    p = place(slots, [1, 2, 3, 4, 5, 6, 7], "a")
    assert p.reuse == 6  # the same tenant reuses everything


def test_an_images_cells_serve_only_the_same_image_and_only_whole():
    # text 1 2, an image at [2, 5) (placeholder 7), text 3 4
    prompt = [1, 2, 7, 7, 7, 3, 4]
    image_a, image_b = (2, 5, b"image:a"), (2, 5, b"image:b")
    held = Slot(0, [1, 2, 7, 7, 7, 3, 4, 9], "t", 1.0, spans=[image_a])
    assert place([held], prompt, "t", spans=[image_a]).reuse == 6  # all but the last
    assert place([held], prompt, "t", spans=[image_b]).reuse == 2  # up to the image
    assert place([held], prompt, "t").reuse == 2  # text ids where it held an image
    cut = Slot(0, [1, 2, 7, 7], "t", 1.0, spans=[image_a])  # never part of an image
    assert place([cut], prompt, "t", spans=[image_a]).reuse == 2
    text = Slot(0, [1, 2, 7, 7, 7, 3], "t", 1.0)  # the same ids, as text
    assert place([text], prompt, "t", spans=[image_a]).reuse == 2
    # a published prefix that ends inside an image: reused up to the image only
    other = Slot(0, [1, 2, 7, 7, 7, 3, 4, 9], "u", 1.0, shared_len=4, spans=[image_a])
    assert place([other], prompt, "t", shared_prefix_len=4, spans=[image_a]).reuse == 2
