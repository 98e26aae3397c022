"""kvgate's GGUF reader (engine.gguf_reader) against gguf's own: the same fields, part for part, from
SmolLM2's GGUF and from a small file of every array kind (scalars, strings, nested, empty) in either
byte order."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from engine.gguf_reader import PlainArrayReader


def assert_same_fields(path) -> None:
    ours, theirs = PlainArrayReader(path, mode="c"), gguf.GGUFReader(path, mode="c")
    assert ours.fields.keys() == theirs.fields.keys()
    for name, field in ours.fields.items():
        other = theirs.fields[name]
        assert (field.offset, field.data, field.types) == (other.offset, other.data, other.types), name
        assert len(field.parts) == len(other.parts), name
        for part, other_part in zip(field.parts, other.parts, strict=True):
            assert part.dtype == other_part.dtype and np.array_equal(part, other_part), name
    assert [(t.name, t.tensor_type, t.data_offset) for t in ours.tensors] == [
        (t.name, t.tensor_type, t.data_offset) for t in theirs.tensors]


def test_the_models_fields_are_gguf_readers(gguf_path):
    assert_same_fields(gguf_path)


@pytest.mark.parametrize("endianess", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_every_array_kind_reads_as_gguf_reads_it(tmp_path, endianess):
    path = tmp_path / "arrays.gguf"
    writer = gguf.GGUFWriter(path, "llama", endianess=endianess)
    writer.add_array("strings", ["a", "", "ünïcode", "b" * 300])
    writer.add_array("floats", [0.5, -1.0, 3.25])
    writer.add_array("ints", [1, -2, 3])
    writer.add_array("nested", [[1, 2], [3]])
    writer.add_array("empty", [])
    writer.add_string("after", "the fields that follow the arrays keep their offsets")
    writer.add_tensor("t", np.arange(6, dtype=np.float32).reshape(2, 3))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_same_fields(path)
