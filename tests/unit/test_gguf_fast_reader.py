"""jinfer's GGUF tensor reader (gguf_meta.open_gguf) against the gguf package's GGUFReader, on files the
gguf package wrote and on the default model (its tensors and metadata)."""


import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from jinfer.weights.gguf import dequantize_tensor
from jinfer.weights.gguf_meta import open_gguf, read_metadata, tensor_names
from jinfer.weights.loader import default_model_path

QUANTIZABLE = (Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1)  # gguf.quants can write these
K_QUANTS = (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)  # no Python quantizer: random blocks


@pytest.fixture(autouse=True)
def _fresh_cache():
    open_gguf.cache_clear()
    yield
    open_gguf.cache_clear()


def _write(path, alignment: int | None = None):
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_block_count(2)
    w.add_string("a.str", "héllo <|im_end|>")
    w.add_array("tokenizer.ggml.tokens", ["", "Ġthe", "日本", "<|endoftext|>"] * 300)
    w.add_array("a.ints", list(range(-5, 300)))
    w.add_array("a.floats", [0.5, -2.0, 1e-3])
    w.add_tensor("norm.f32", rng.normal(size=7).astype(np.float32))  # odd sizes: offsets need the padding
    w.add_tensor("mat.f32", rng.normal(size=(3, 5)).astype(np.float32))
    w.add_tensor("cube.f32", rng.normal(size=(2, 3, 4)).astype(np.float32))
    w.add_tensor("mat.f16", rng.normal(size=(5, 3)).astype(np.float16))
    x = rng.normal(0, 0.05, size=(4, 256)).astype(np.float32)
    for qtype in QUANTIZABLE:
        w.add_tensor(f"mat.{qtype.name}", gguf.quants.quantize(x, qtype), raw_dtype=qtype)
    big = rng.normal(size=(130, 1024)).astype(np.float32)  # 4160 blocks: more than one dequantize chunk
    w.add_tensor("big.Q4_1", gguf.quants.quantize(big, Q.Q4_1), raw_dtype=Q.Q4_1)
    w.add_tensor("cube.Q8_0", gguf.quants.quantize(rng.normal(size=(2, 3, 64)).astype(np.float32), Q.Q8_0),
                 raw_dtype=Q.Q8_0)
    for qtype in K_QUANTS:
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, size=(3, 512 // block * type_size), dtype=np.uint8)
        w.add_tensor(f"mat.{qtype.name}", raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _assert_same_tensors(path, dequantize_all: bool = True, ref: gguf.GGUFReader | None = None) -> set[str]:
    ref = ref or gguf.GGUFReader(str(path), "r")
    ours = open_gguf(str(path))
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    checked: set[str] = set()
    for a, b in zip(ours.tensors, ref.tensors, strict=True):
        assert a.shape == tuple(int(d) for d in b.shape), a.name
        assert a.tensor_type == b.tensor_type and isinstance(a.tensor_type, Q), a.name
        assert (a.n_elements, a.n_bytes, a.data_offset) == (b.n_elements, b.n_bytes, b.data_offset), a.name
        assert a.data.dtype == np.uint8 and not a.data.flags.writeable, a.name
        np.testing.assert_array_equal(a.data.reshape(-1), b.data.reshape(-1).view(np.uint8), err_msg=a.name)
        if dequantize_all or a.tensor_type.name not in checked:
            got, want = dequantize(a.data, a.tensor_type), dequantize(b.data, b.tensor_type)
            assert got.dtype == want.dtype == np.float32 and got.shape == want.shape, a.name
            assert got.size == a.n_elements and np.isfinite(got).any(), a.name
            np.testing.assert_array_equal(got, want, err_msg=a.name)
            np.testing.assert_array_equal(dequantize_tensor(a), want.reshape(-1), err_msg=a.name)
        checked.add(a.tensor_type.name)
    return checked


@pytest.mark.parametrize("alignment", [None, 64])
def test_tensors_match_the_gguf_package(tmp_path, alignment):
    path = _write(tmp_path / "t.gguf", alignment)
    types = _assert_same_tensors(path)
    assert types == {"F32", "F16", *(q.name for q in QUANTIZABLE), *(q.name for q in K_QUANTS)}
    f = open_gguf(str(path))
    assert f.alignment == (alignment or 32) and f.data_start % f.alignment == 0
    assert tensor_names(path) == {t.name for t in f.tensors}
    assert read_metadata(path)["tokenizer.ggml.tokens"][:4] == ["", "Ġthe", "日本", "<|endoftext|>"]


def test_cached_and_never_uses_gguf_reader(tmp_path, monkeypatch):
    """The runtime path (names, tensors, the weight source) reads no file through GGUFReader."""
    from types import SimpleNamespace

    from jinfer.models.spec import ArrayInfo
    from jinfer.weights.gguf import GGUFTensorSource

    path = _write(tmp_path / "t.gguf")
    ref = {t.name: dequantize(t.data, t.tensor_type) for t in gguf.GGUFReader(str(path), "r").tensors}

    def refuse(*args, **kwargs):
        raise AssertionError("GGUFReader used")

    monkeypatch.setattr(gguf, "GGUFReader", refuse)
    monkeypatch.setattr(gguf.gguf_reader, "GGUFReader", refuse)
    assert open_gguf(str(path)) is open_gguf(str(path))
    assert "mat.Q6_K" in tensor_names(path)
    source = GGUFTensorSource(path, SimpleNamespace(architecture="qwen2"))
    for name, shape in [("mat.Q6_K", (3, 512)), ("big.Q4_1", (130, 1024)), ("mat.BF16", (4, 256)), ("mat.f16", (5, 3)),
                        ("cube.f32", (2, 3, 4)), ("norm.f32", (7,))]:
        got = source.get(ArrayInfo(shape, (None,) * len(shape), "x", name))
        assert got.dtype == np.float32 and got.shape == shape, name
        np.testing.assert_array_equal(got, ref[name].reshape(shape), err_msg=name)


def test_truncated_or_garbage_file_is_a_value_error_naming_it(tmp_path):
    whole = _write(tmp_path / "t.gguf").read_bytes()
    f = open_gguf(str(tmp_path / "t.gguf"))
    last = max(t.data_offset + t.n_bytes for t in f.tensors)  # the writer pads the file past it
    cuts = sorted({0, 3, 4, 20, 24, 30, 100, 2000, f.data_start - 40, f.data_start - 1, f.data_start + 5, last - 1})
    for cut in cuts:
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(whole[:cut])
        with pytest.raises(ValueError, match=f"cut{cut}.gguf"):
            open_gguf(str(path))
    rng = np.random.default_rng(1)
    for i in range(20):  # a valid start, then noise: no IndexError/struct.error/MemoryError may escape
        path = tmp_path / f"noise{i}.gguf"
        path.write_bytes(whole[:24 + 37 * i] + rng.integers(0, 256, 3000, dtype=np.uint8).tobytes())
        try:
            open_gguf(str(path))
        except ValueError as e:
            assert f"noise{i}.gguf" in str(e)
    with pytest.raises(ValueError, match="not found"):
        open_gguf(str(tmp_path / "missing.gguf"))


def test_bad_tensor_infos(tmp_path):
    whole = bytearray(_write(tmp_path / "t.gguf").read_bytes())
    f = open_gguf(str(tmp_path / "t.gguf"))
    first = f.tensors[0]  # norm.f32: name, n_dims=1, dims, type, offset lie just before the next info
    at = whole.index(first.name.encode()) + len(first.name) + 4 + 8
    bad_type = bytearray(whole)
    bad_type[at:at + 4] = (999).to_bytes(4, "little")
    (tmp_path / "type.gguf").write_bytes(bad_type)
    with pytest.raises(ValueError, match="type.gguf.*unknown GGML type 999"):
        open_gguf(str(tmp_path / "type.gguf"))
    bad_offset = bytearray(whole)
    bad_offset[at + 4:at + 12] = (len(whole)).to_bytes(8, "little")
    (tmp_path / "offset.gguf").write_bytes(bad_offset)
    with pytest.raises(ValueError, match="offset.gguf.*past the end"):
        open_gguf(str(tmp_path / "offset.gguf"))


@pytest.fixture(scope="module")
def default_reference():
    """The default model's GGUF and the gguf package's reader of it (~5 s to build: shared by the two tests)."""
    ggufs = sorted(default_model_path().parent.glob("*.gguf"))
    if not ggufs:
        pytest.skip("default model not fetched")
    return ggufs[0], gguf.GGUFReader(str(ggufs[0]), "r")


def test_default_model_tensors_match(default_reference):
    path, ref = default_reference
    types = _assert_same_tensors(path, dequantize_all=False, ref=ref)
    assert {"F32", "Q4_1"} <= types


def test_default_model_metadata_matches(default_reference):
    path, ref = default_reference
    assert read_metadata(path) == {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
