from backend_local.text_stream import TextStream


def feed(stream: TextStream, pieces: list[bytes]) -> tuple[str, str | None]:
    """The text emitted, and the stop string that ended it (None: none did)."""
    out = []
    for piece in pieces:
        text, stop = stream.add(piece)
        out.append(text)
        if stop is not None:
            return "".join(out), stop
    return "".join(out) + stream.flush(), None


def test_multibyte_character_split_over_tokens_is_emitted_once_whole():
    data = "né 日本 🙂".encode()
    stream = TextStream([])
    deltas = [stream.add(data[i : i + 1])[0] for i in range(len(data))]
    assert "".join(deltas) == "né 日本 🙂"
    assert all("\ufffd" not in d for d in deltas)
    # A delta never holds a broken character: the 4-byte emoji arrives whole in one delta.
    assert "🙂" in deltas


def test_stop_string_spanning_pieces_ends_and_is_not_emitted():
    text, stopped = feed(TextStream(["END"]), [b"hello E", b"N", b"D more"])
    assert (text, stopped) == ("hello ", "END")


def test_partial_stop_match_that_fails_is_emitted():
    stream = TextStream(["STOP"])
    assert stream.add(b"a ST") == ("a ", None)  # "ST" may begin "STOP": held back
    assert stream.add(b"ANDS") == ("STAND", None)  # it did not; "S" is held again
    assert stream.flush() == "S"


def test_earliest_of_several_stop_strings_wins():
    text, stopped = feed(TextStream(["xyz", "\n\n"]), [b"one\n\ntwo xyz"])
    assert (text, stopped) == ("one", "\n\n")  # the one that matched, not the first listed


def test_multibyte_stop_string_split_inside_a_character():
    data = "ok。rest".encode()
    cut = data.index("。".encode()) + 1  # split inside the 3-byte character
    text, stopped = feed(TextStream(["。"]), [data[:cut], data[cut:]])
    assert (text, stopped) == ("ok", "。")


def test_no_stop_means_everything_is_emitted():
    assert feed(TextStream(["never"]), [b"abc", b"nev", b"e"]) == ("abcneve", None)
