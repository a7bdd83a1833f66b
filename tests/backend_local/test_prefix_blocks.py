from backend_local.prefix_blocks import BLOCK_SIZE, BlockLedger, block_hashes


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def test_only_full_blocks_are_hashed_and_the_chain_covers_the_whole_prefix():
    assert block_hashes(tokens(BLOCK_SIZE - 1), "a") == []
    two = block_hashes(tokens(2 * BLOCK_SIZE + 5), "a")
    assert len(two) == 2 and len(set(two)) == 2
    assert block_hashes(tokens(BLOCK_SIZE), "a") == two[:1]
    # a different first block changes every later hash, not only its own
    other = block_hashes([99] + tokens(2 * BLOCK_SIZE - 1, 1), "a")
    assert other[0] != two[0] and other[1] != two[1]


def test_the_salt_separates_tenants_except_inside_the_published_prefix():
    prompt = tokens(3 * BLOCK_SIZE)
    a, b = block_hashes(prompt, "a"), block_hashes(prompt, "b")
    assert not set(a) & set(b)
    # published prefix of 2 blocks and a bit: the 2 blocks are shared, the 3rd is not
    shared_a = block_hashes(prompt, "a", 2 * BLOCK_SIZE + 3)
    shared_b = block_hashes(prompt, "b", 2 * BLOCK_SIZE + 3)
    assert shared_a[:2] == shared_b[:2] == block_hashes(prompt, None)[:2]
    assert shared_a[2] != shared_b[2]


def test_ledger_stores_on_the_first_holder_and_removes_after_the_last():
    ledger = BlockLedger()
    prompt = tokens(2 * BLOCK_SIZE)
    h = block_hashes(prompt, "a")
    ledger.replace([], h, "a", 0)  # slot 0 computes two blocks
    stored = ledger.take_events()
    assert [(e.kind, e.block_hash, e.parent_hash, e.cache_salt) for e in stored] == [
        ("stored", h[0], None, "a"),
        ("stored", h[1], h[0], "a"),
    ]
    assert all(e.num_tokens == BLOCK_SIZE for e in stored)
    ledger.replace([], h[:1], "a", 0)  # slot 1 copies the first block: still one holder
    assert ledger.take_events() == []
    ledger.replace(h, [], "a", 0)  # slot 0 is overwritten: block 1 is gone, block 0 stays
    assert [(e.kind, e.block_hash) for e in ledger.take_events()] == [("removed", h[1])]
    ledger.replace(h[:1], [], "a", 0)
    assert [(e.kind, e.block_hash) for e in ledger.take_events()] == [("removed", h[0])]
    assert ledger.refs == {}


def test_published_blocks_are_stored_without_a_salt():
    ledger = BlockLedger()
    h = block_hashes(tokens(2 * BLOCK_SIZE), "a", BLOCK_SIZE)
    ledger.replace([], h, "a", BLOCK_SIZE)
    assert [e.cache_salt for e in ledger.take_events()] == [None, "a"]
