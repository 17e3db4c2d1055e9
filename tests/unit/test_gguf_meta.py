"""jinfer's GGUF metadata parser against the gguf package's reader on files the gguf package wrote."""

import gguf
import numpy as np
import pytest

from jinfer.weights.gguf_meta import read_metadata


def _reference(path) -> dict:
    reader = gguf.GGUFReader(str(path), "r")
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def test_matches_the_gguf_package(tmp_path):
    path = tmp_path / "meta.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("a.u32", 7)
    w.add_int32("a.i32", -3)
    w.add_float32("a.f32", 0.25)
    w.add_float64("a.f64", -1.5e300)
    w.add_uint64("a.u64", 2**63 + 5)
    w.add_int64("a.i64", -(2**40))
    w.add_bool("a.bool", True)
    w.add_uint8("a.u8", 255)
    w.add_int16("a.i16", -300)
    w.add_string("a.str", "héllo <|im_end|>")
    w.add_array("a.strs", ["", "Ġthe", "日本", "<|endoftext|>"] * 50)
    w.add_array("a.ints", list(range(-5, 300)))
    w.add_array("a.floats", [0.5, -2.0, 1e-3])
    w.add_array("a.bools", [True, False, True])
    w.add_tensor("t", np.zeros((2, 3), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours, ref = read_metadata(path), _reference(path)
    assert ours.keys() == ref.keys()
    for k in ref:
        if isinstance(ref[k], float) or (isinstance(ref[k], list) and ref[k] and isinstance(ref[k][0], float)):
            np.testing.assert_allclose(ours[k], ref[k], rtol=1e-7, err_msg=k)
        else:
            assert ours[k] == ref[k], k


@pytest.mark.parametrize("content", [b"", b"GGUF", b"NOPE" + bytes(40), b"GGUF\x03\x00\x00\x00" + bytes(8)
                                     + (5).to_bytes(8, "little") + bytes(3)])
def test_garbage_is_a_value_error(tmp_path, content):
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="GGUF"):
        read_metadata(path)
