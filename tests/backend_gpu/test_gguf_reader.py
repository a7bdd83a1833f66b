"""The transformers reference's GGUF reader (reference.ArraysAtOnce) reads the same
fields as gguf's own: every part, data index and type, on a file with each kind of
array a vocabulary has (strings, floats, integers) beside the kinds it leaves to gguf
(empty, nested). The Gemma 3 GGUF test builds transformers' model from what it reads."""

from __future__ import annotations

import gguf
import numpy as np

from tests.backend_gpu.reference import ArraysAtOnce


def test_arrays_read_at_once_are_the_fields_gguf_reads(tmp_path):
    path = str(tmp_path / "vocabulary.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    tokens = ["<pad>", "a", "", "naïve", "東京", "▁the"] * 50
    writer.add_token_list(tokens)
    writer.add_token_scores([float(-i) / 3 for i in range(len(tokens))])
    writer.add_token_types([i % 6 for i in range(len(tokens))])
    writer.add_array("test.bools", [True, False, True])
    writer.add_array("test.empty", [])
    writer.add_array("test.nested", [[1, 2], [3]])
    writer.add_uint32("test.scalar", 7)
    writer.add_string("test.string", "one string")
    writer.add_tensor("weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    ours, theirs = ArraysAtOnce(path), gguf.GGUFReader(path)
    assert list(ours.fields) == list(theirs.fields)
    for name, want in theirs.fields.items():
        got = ours.fields[name]
        assert (got.offset, got.data, got.types) == (want.offset, want.data, want.types), name
        assert len(got.parts) == len(want.parts), name
        for a, b in zip(got.parts, want.parts, strict=True):
            assert (a.dtype, a.shape) == (b.dtype, b.shape) and np.array_equal(a, b), name
    assert ours.fields["tokenizer.ggml.tokens"].contents() == tokens
    assert ours.fields["tokenizer.ggml.scores"].contents()[3] == np.float32(-1.0)
    (tensor,) = ours.tensors
    assert np.array_equal(tensor.data, theirs.tensors[0].data)
