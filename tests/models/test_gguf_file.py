"""GGUFFile against gguf-py's GGUFReader: the same metadata values and the same
tensor arrays, on the default model and on files written here; clear errors on
files it cannot read; and the memory it saves (the reason it exists)."""

import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from gguf import GGMLQuantizationType as GGMLType
from gguf import GGUFEndian, GGUFReader, GGUFValueType, GGUFWriter, quants

from cadence.models.default_model import default_model_path
from cadence.models.gguf_file import GGUFFile
from tests.models import ggml_blocks


def reference_metadata(reader: GGUFReader) -> dict:
    """What cadence decoded from GGUFReader's fields before GGUFFile (the values to keep)."""
    return {name: _reference_value(field) for name, field in reader.fields.items()
            if not name.startswith("GGUF.")}


def _reference_value(field):
    kind = field.types[0]
    if kind == GGUFValueType.ARRAY:
        items = [field.parts[i] for i in field.data]
        if field.types[-1] == GGUFValueType.STRING:
            return [bytes(item).decode("utf-8", errors="replace") for item in items]
        return np.concatenate(items).tolist() if items else []
    value = field.parts[field.data[0]]
    if kind == GGUFValueType.STRING:
        return bytes(value).decode("utf-8", errors="replace")
    if kind == GGUFValueType.FLOAT32:
        return float(str(value[0]))
    return value[0].item()


def typed(value):
    """``value`` with the Python type of every item, so 1 == 1.0 == True tell apart."""
    return [typed(item) for item in value] if isinstance(value, list) else (type(value), value)


def assert_same_as_gguf_reader(path):
    ours, theirs = GGUFFile(path), GGUFReader(path)
    expected = reference_metadata(theirs)
    assert list(ours.metadata) == list(expected)
    assert {key: typed(value) for key, value in ours.metadata.items()} == \
           {key: typed(value) for key, value in expected.items()}
    assert ours.data_offset == theirs.data_offset and ours.alignment == theirs.alignment
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, ref in zip(ours.tensors, theirs.tensors):
        assert mine.tensor_type == ref.tensor_type and mine.shape == tuple(ref.shape.tolist()), mine.name
        assert (mine.n_elements, mine.n_bytes, mine.data_offset) == (ref.n_elements, ref.n_bytes, ref.data_offset)
        assert mine.data.dtype == ref.data.dtype and mine.data.shape == ref.data.shape, mine.name
        assert np.array_equal(mine.data, ref.data), mine.name
        assert not mine.data.flags.writeable  # a view of the read-only mapping, as GGUFReader's
    return ours


def test_default_model_reads_as_gguf_reader_reads_it():
    gguf = assert_same_as_gguf_reader(default_model_path())
    assert len(gguf.metadata["tokenizer.ggml.tokens"]) == 49152
    assert {t.tensor_type for t in gguf.tensors} >= {GGMLType.Q4_1, GGMLType.F32}


# ------------------------------------------------------------- files written here

SCALARS = {
    "t.u8": (255, GGUFValueType.UINT8), "t.i8": (-128, GGUFValueType.INT8),
    "t.u16": (65535, GGUFValueType.UINT16), "t.i16": (-32768, GGUFValueType.INT16),
    "t.u32": (2**32 - 1, GGUFValueType.UINT32), "t.i32": (-(2**31), GGUFValueType.INT32),
    "t.u64": (2**64 - 1, GGUFValueType.UINT64), "t.i64": (-(2**63), GGUFValueType.INT64),
    "t.f32": (1e-5, GGUFValueType.FLOAT32), "t.f64": (0.1, GGUFValueType.FLOAT64),
    "t.true": (True, GGUFValueType.BOOL), "t.false": (False, GGUFValueType.BOOL),
    "t.str": ("héllo ▁wörld", GGUFValueType.STRING),
}
ARRAYS = {
    "a.u8": ([0, 7, 255], GGUFValueType.UINT8), "a.i8": ([-1, 2], GGUFValueType.INT8),
    "a.u16": ([1, 65535], GGUFValueType.UINT16), "a.i16": ([-5, 5], GGUFValueType.INT16),
    "a.u32": ([3, 4], GGUFValueType.UINT32), "a.i32": ([-7, 0, 7], GGUFValueType.INT32),
    "a.u64": ([2**63], GGUFValueType.UINT64), "a.i64": ([-(2**40), 1], GGUFValueType.INT64),
    "a.f32": ([0.1, -2.5], GGUFValueType.FLOAT32), "a.f64": ([0.1, 1e300], GGUFValueType.FLOAT64),
    "a.bool": ([True, False, True], GGUFValueType.BOOL),
    "a.str": (["a", "", "Ġthe", "ü"], GGUFValueType.STRING),
}


def tensors_of_every_kind(rng):
    """name -> (values or raw bytes as GGUFWriter takes them, ggml type)."""
    values = rng.standard_normal((4, 256)).astype(np.float32)
    return {
        "f32": (rng.standard_normal((2, 3, 32)).astype(np.float32), GGMLType.F32),
        "f16": (values.astype(np.float16), GGMLType.F16),
        "bf16": (quants.quantize(values, GGMLType.BF16), GGMLType.BF16),
        "q8_0": (quants.quantize(values, GGMLType.Q8_0), GGMLType.Q8_0),
        "q4_0": (quants.quantize(values, GGMLType.Q4_0), GGMLType.Q4_0),
        "q4_k": (ggml_blocks.random_blocks("Q4_K", 4, rng).reshape(4, -1), GGMLType.Q4_K),
        "q6_k": (ggml_blocks.random_blocks("Q6_K", 2, rng).reshape(2, -1), GGMLType.Q6_K),
        "i32": (np.arange(10, dtype=np.int32), GGMLType.I32),
        "vector": (values[0], GGMLType.F32),
    }


def write_file(path, alignment=None, endianess=GGUFEndian.LITTLE):
    writer = GGUFWriter(str(path), "llama", endianess=endianess)
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    for key, (value, kind) in SCALARS.items():
        writer.add_key_value(key, value, kind)
    for key, (value, kind) in ARRAYS.items():
        writer.add_key_value(key, value, GGUFValueType.ARRAY, sub_type=kind)
    writer.add_key_value("a.nested", [[1, 2], [3]], GGUFValueType.ARRAY)
    for name, (data, kind) in tensors_of_every_kind(np.random.default_rng(0)).items():
        writer.add_tensor(name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.mark.parametrize("alignment", [None, 64])
def test_every_value_and_tensor_type_reads_as_gguf_reader_reads_it(tmp_path, alignment):
    gguf = assert_same_as_gguf_reader(write_file(tmp_path / "all.gguf", alignment))
    assert gguf.alignment == (alignment or 32) and gguf.data_offset % gguf.alignment == 0
    # The values themselves, not only their agreement with gguf-py.
    assert typed(gguf.metadata["t.f32"]) == (float, 1e-5)  # the shortest decimal of the float32
    assert gguf.metadata["a.f32"] == [float(np.float32(0.1)), -2.5]  # items: the float32 values
    assert typed(gguf.metadata["t.true"]) == (bool, True) and gguf.metadata["a.bool"] == [True, False, True]
    assert gguf.metadata["t.str"] == "héllo ▁wörld" and gguf.metadata["a.str"] == ["a", "", "Ġthe", "ü"]
    assert gguf.metadata["a.nested"] == [1, 2, 3]  # flattened, as gguf-py's fields are
    assert gguf.value_types["t.u16"] == GGUFValueType.UINT16
    f32 = next(t for t in gguf.tensors if t.name == "f32")
    assert f32.shape == (32, 3, 2) and f32.data.shape == (2, 3, 32)


def kv_only_file(path, body: bytes, num_kvs: int, version: int = 3) -> str:
    """A GGUF with no tensors and ``num_kvs`` key/values packed by hand in ``body``."""
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", version, 0, num_kvs) + body)
    return str(path)


def packed_string(text: str) -> bytes:
    return struct.pack("<Q", len(text.encode())) + text.encode()


def test_empty_arrays_read_as_empty_lists(tmp_path):
    # GGUFWriter refuses to write an empty array, so the file is packed here.
    body = b"".join(packed_string(key) + struct.pack("<IIQ", GGUFValueType.ARRAY, kind, 0)
                    for key, kind in (("e.u32", GGUFValueType.UINT32), ("e.str", GGUFValueType.STRING)))
    gguf = assert_same_as_gguf_reader(kv_only_file(tmp_path / "e.gguf", body, 2))
    assert gguf.metadata == {"e.u32": [], "e.str": []} and gguf.tensors == []


def test_version_2_reads(tmp_path):
    body = packed_string("general.name") + struct.pack("<I", GGUFValueType.STRING) + packed_string("v2")
    assert GGUFFile(kv_only_file(tmp_path / "v2.gguf", body, 1, version=2)).metadata == {"general.name": "v2"}


# ------------------------------------------------------------------------ errors


def refused(path, match):
    with pytest.raises(ValueError, match=match) as error:
        GGUFFile(path)
    assert str(path) in str(error.value)


def test_refuses_a_bad_magic(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGML" + bytes(20))
    refused(path, "not a GGUF file")


@pytest.mark.parametrize("version", [1, 4])
def test_refuses_other_versions(tmp_path, version):
    refused(kv_only_file(tmp_path / "v.gguf", b"", 0, version), f"version {version} is not supported")


def test_refuses_big_endian_files(tmp_path):
    refused(write_file(tmp_path / "be.gguf", endianess=GGUFEndian.BIG), "big-endian")


@pytest.mark.parametrize("num_bytes", [0, 3, 10, 20])
def test_refuses_a_truncated_header(tmp_path, num_bytes):
    full = (write_file(tmp_path / "full.gguf"), tmp_path / "cut.gguf")
    full[1].write_bytes(open(full[0], "rb").read()[:num_bytes])
    refused(full[1], "truncated GGUF file")


def test_refuses_truncated_metadata_and_tensor_infos(tmp_path):
    full = write_file(tmp_path / "full.gguf")
    data, data_offset = open(full, "rb").read(), GGUFFile(full).data_offset
    cut = tmp_path / "cut.gguf"
    for num_bytes, what in ((60, "general.architecture"), (700, "a.f64"), (data_offset - 40, "tensor 'vector'")):
        cut.write_bytes(data[:num_bytes])
        refused(cut, f"truncated GGUF file: .*{what}")


def test_refuses_truncated_tensor_data(tmp_path):
    data = open(write_file(tmp_path / "full.gguf"), "rb").read()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:-100])
    refused(cut, "truncated GGUF file: tensor 'vector'")


def test_refuses_an_array_longer_than_the_file(tmp_path):
    body = packed_string("huge") + struct.pack("<IIQ", GGUFValueType.ARRAY, GGUFValueType.STRING, 2**60)
    refused(kv_only_file(tmp_path / "h.gguf", body, 1), "truncated GGUF file: the items of 'huge'")


def test_refuses_an_unknown_value_type(tmp_path):
    body = packed_string("odd") + struct.pack("<I", 99)
    refused(kv_only_file(tmp_path / "o.gguf", body, 1), "99, no GGUF value type")


# ------------------------------------------------------------------------ memory

_MEMORY_SCRIPT = """
import gc
from cadence.models.default_model import default_model_path
from cadence.models.gguf_loader import load_gguf_model, read_gguf

def kib(field):
    return int(next(l for l in open("/proc/self/status") if l.startswith(field)).split()[1])

gc.collect()
before = kib("VmRSS")
reader, metadata = read_gguf(default_model_path())
read_growth = kib("VmRSS") - before
model, _ = load_gguf_model(reader, metadata, quantization="auto")
del reader, metadata
gc.collect()
transient = kib("VmHWM") - kib("VmRSS")  # what the load held beyond what it keeps
print(read_growth / 1024, transient / 1024)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_reading_and_loading_the_default_model_cost_little_memory():
    # With gguf-py's GGUFReader, read_gguf grew RSS by ~174 MiB (an array per part
    # of every tokenizer string); the Python values take ~10 MiB. Without dropping
    # each tensor's mapped pages once copied, the load held the whole file (~95 MiB)
    # on top of the weights it keeps; now ~15-50 MiB (it varies with the heap).
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(_MEMORY_SCRIPT)],
                         capture_output=True, text=True, check=True)
    read_growth_mib, transient_mib = map(float, out.stdout.strip().splitlines()[-1].split())
    assert read_growth_mib < 40, f"read_gguf grew RSS by {read_growth_mib:.0f} MiB"
    assert transient_mib < 75, f"loading held {transient_mib:.0f} MiB more than it keeps"


def test_dropped_pages_read_back_the_same(tmp_path):
    gguf = GGUFFile(write_file(tmp_path / "all.gguf"))
    copies = [tensor.data.copy() for tensor in gguf.tensors]
    for tensor in gguf.tensors:
        gguf.drop_pages(tensor)
    assert all(np.array_equal(copy, tensor.data) for copy, tensor in zip(copies, gguf.tensors))
