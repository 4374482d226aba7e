"""Issue #11's malformed-file corpus, generated here (no binaries committed): ~360 kinds of broken, odd and hostile
files, each read the three ways the pack reads a file (the header reader, the loader's cache.read, the Info node's
summary) and a representative subset through the LyCORIS Loader node on a real (tiny) SD1.5 model. The loader's and
the summary's readings of each file must agree as parse_agreement.py states (issue #37).

For every case: the file parses, or a LycorisError names the file (and, where one key is at fault, the key) in a
bounded, UTF-8-encodable text; never another exception, never a hang, never unpickling, never a byte of a file
outside the loras folder in an error, NaN/Inf refused naming file and key, and a refused file leaves the model as it
was. The truth for data bit flips is the official `safetensors` library's decoding of the same bytes.
"""

import json
import math
import os
import pickle
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import test_nodes
import torch
from lycoris_nodes.lycoris_core import LycorisError, SafetensorsFile
from lycoris_nodes.lycoris_core.errors import MAX_NAME, MAX_REASON
from lycoris_nodes.lycoris_core.summary import summarize
from lycoris_nodes.nodes.glue import cache
from lycoris_nodes.nodes.inspection.info import LycorisInfo
from lycoris_nodes.nodes.loading.loaders import LycorisLoader
from node_runner import execute
from parse_agreement import assert_loader_and_summary_agree
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from test_nodes import TE_Q_KEY, TO_Q, TO_Q_KEY

sd15 = test_nodes.sd15  # fixtures: the tiny SD1.5 checkpoint, an empty listed loras folder
loras = test_nodes.loras

MAX_MESSAGE = 2 * MAX_NAME + MAX_REASON + 200  # file + key + reason, each clipped, and the clip notes
UP, DOWN, ALPHA = f"{TO_Q}.lora_up.weight", f"{TO_Q}.lora_down.weight", f"{TO_Q}.alpha"
RANK = 2


@dataclass
class Case:
    path: Path
    refused: str | None = None  # "header": all three readers refuse; "load": the loader refuses (the summary may
    #                             read it); "never": a valid file everyone reads; None: either, as long as it is clean
    key: str | None = None  # what a refusal must name besides the file (a key, or the module prefix)
    secret: bytes | None = None  # content of a file outside the loras folder that no error may show
    marker: Path | None = None  # a file that unpickling would create
    fifo: bool = False  # opening it for reading blocks until a writer comes


# --- building files ------------------------------------------------------------------------------------------------

def base_tensors(dtype=torch.float32) -> dict[str, torch.Tensor]:
    """A rank-2 LoRA on the tiny SD1.5's first to_q (320×320), with alpha."""
    g = torch.Generator().manual_seed(11)
    return {UP: (torch.randn(320, RANK, generator=g) * 0.05).to(dtype),
            DOWN: (torch.randn(RANK, 320, generator=g) * 0.05).to(dtype), ALPHA: torch.tensor(1.0)}


def base_bytes(metadata: dict[str, str] | None = None, tensors: dict | None = None) -> bytes:
    return st_save(tensors if tensors is not None else base_tensors(), metadata=metadata)


def split(data: bytes) -> tuple[dict, bytes]:
    """(header JSON, tensor bytes) of a safetensors file."""
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n]), data[8 + n:]


def join(header: dict | str | bytes, body: bytes = b"") -> bytes:
    raw = header if isinstance(header, bytes) else (header if isinstance(header, str) else json.dumps(header)).encode()
    return struct.pack("<Q", len(raw)) + raw + body


def edited(edit: Callable[[dict], object], body: Callable[[bytes], bytes] = lambda b: b) -> bytes:
    """The base file with its header JSON edited in place (edit returns nothing) and its data transformed."""
    header, data = split(base_bytes())
    edit(header)
    return join(header, body(data))


def edited_text(old: str, new: str) -> bytes:
    """The base file with the first `old` in its header text replaced (JSON no encoder here would write)."""
    header, data = split(BASE)
    return join(json.dumps(header).replace(old, new, 1), data)


def entry_edit(key: str, **fields) -> Callable[[dict], None]:
    return lambda header: header[key].update(fields)


def write(folder: Path, name: str, data: bytes) -> Path:
    path = folder / name
    path.write_bytes(data)
    return path


# Each maker: (loras folder, a folder outside it) -> Case.
Maker = Callable[[Path, Path], Case]
CASES: dict[str, Maker] = {}


def case(name: str, data: bytes | Callable[[], bytes], refused: str | None = None, key: str | None = None) -> None:
    """Register a case whose file is these bytes (or what this function returns)."""
    def make(folder: Path, _outside: Path) -> Case:
        return Case(write(folder, "case.safetensors", data() if callable(data) else data), refused, key)
    assert name not in CASES, name
    CASES[name] = make


def maker(name: str):
    def register(function: Maker) -> Maker:
        assert name not in CASES, name
        CASES[name] = function
        return function
    return register


BASE = base_bytes()
HEADER_LEN = int.from_bytes(BASE[:8], "little")
DATA_START = 8 + HEADER_LEN

# --- the valid base file and valid oddities ------------------------------------------------------------------------
case("valid base file", BASE, "never")
case("valid: header padded with trailing spaces", lambda: join(json.dumps(split(BASE)[0]) + " " * 13, split(BASE)[1]),
     "never")
case("valid: fp16 factors", lambda: base_bytes(tensors=base_tensors(torch.float16)), "never")
case("valid: bf16 factors", lambda: base_bytes(tensors=base_tensors(torch.bfloat16)), "never")
case("valid: alpha of shape (1,)", lambda: base_bytes(tensors={**base_tensors(), ALPHA: torch.tensor([1.0])}),
     "never")
case("valid: bf16 alpha", lambda: base_bytes(tensors={**base_tensors(), ALPHA: torch.tensor(1.0).bfloat16()}),
     "never")
case("valid: no alpha", lambda: base_bytes(tensors={k: v for k, v in base_tensors().items() if k != ALPHA}), "never")
case("valid: alpha 0", lambda: base_bytes(tensors={**base_tensors(), ALPHA: torch.tensor(0.0)}), "never")
case("valid: negative alpha", lambda: base_bytes(tensors={**base_tensors(), ALPHA: torch.tensor(-3.0)}), "never")
case("valid: huge finite alpha", lambda: base_bytes(tensors={**base_tensors(), ALPHA: torch.tensor(3e38)}), "never")
case("valid: subnormal factors", lambda: base_bytes(tensors={**base_tensors(), UP: torch.full((320, RANK), 1e-45)}),
     "never")
case("valid: empty metadata", lambda: base_bytes(metadata={}), "never")
case("valid: metadata values that are not JSON", lambda: base_bytes(metadata={
    "software": "{", "ss_tag_frequency": "[", "lycoris_config": "}", "ss_network_args": "\x00"}), "never")
# The loader reads lora_adapter_metadata (a PEFT file's scale): it may refuse a broken one, naming the file.
case("lora_adapter_metadata not JSON", lambda: base_bytes(metadata={"lora_adapter_metadata": "nul"}), None)
case("valid: unknown extra keys beside the module", lambda: base_bytes(tensors={
    **base_tensors(), "something.else": torch.ones(3), "__odd__": torch.ones(1)}), "never")
case("valid: extra unrelated __metadata__ entries", lambda: base_bytes(metadata={f"k{i}": "v" * i for i in range(300)}),
     "never")
case("valid: duplicate key in header JSON (same entry twice)",
     lambda: join(json.dumps(split(BASE)[0])[:-1] + ", " + json.dumps({ALPHA: split(BASE)[0][ALPHA]})[1:],
                  split(BASE)[1]), None)
# Metadata that only the summary parses can never block applying a valid file (issue #11: a 50k-deep lycoris_config).
for meta_key in ("lycoris_config", "software", "ss_tag_frequency", "lora_adapter_metadata", "ss_network_args",
                 "modelspec.trigger_phrase"):
    expected = None if meta_key == "lora_adapter_metadata" else "never"  # the loader reads that one (see above)
    valid = "valid: " if expected else ""
    case(f"{valid}50k-deep JSON in metadata {meta_key}",
         lambda k=meta_key: base_bytes(metadata={k: "[" * 50_000 + "]" * 50_000}), expected)
    case(f"{valid}5000-digit number in metadata {meta_key}",
         lambda k=meta_key: base_bytes(metadata={k: '{"a": ' + "9" * 5000 + ', "b": {"c": ' + "7" * 5000 + "}}"}),
         expected)
    case(f"{valid}1e400 and NaN in metadata {meta_key}",
         lambda k=meta_key: base_bytes(metadata={k: '{"a": 1e400, "b": NaN, "c": -Infinity, "d": [1e400]}'}), expected)
case("valid: ss_tag_frequency of odd shapes", lambda: base_bytes(metadata={
    "ss_tag_frequency": json.dumps({"a": {"x": "9" * 5000, "y": -1, "z": 1.5, "": 2}, "b": [1], "c": None})}), "never")
case("lora_adapter_metadata not an object", lambda: base_bytes(metadata={"lora_adapter_metadata": "[1, 2]"}), None)
case("lora_adapter_metadata with odd values", lambda: base_bytes(metadata={"lora_adapter_metadata": json.dumps(
    {"r": "x", "lora_alpha": [1], "rank_pattern": 5, "alpha_pattern": {"(": 1}, "use_rslora": "yes"})}), None)
case("lora_adapter_metadata with a pattern that is no regular expression", lambda: base_bytes(metadata={
    "lora_adapter_metadata": json.dumps({"r": 4, "lora_alpha": 8, "rank_pattern": {"(": 2}, "alpha_pattern": {"[": 1}})}),
    None)
case("valid: lycoris_config a JSON string", lambda: base_bytes(metadata={"lycoris_config": '"just text"'}), "never")
case("valid: 1 MB metadata value", lambda: base_bytes(metadata={"ss_training_comment": "c" * 1_000_000}), "never")

# --- truncations ---------------------------------------------------------------------------------------------------
for cut in (0, 1, 4, 7, 8, 9, 12, DATA_START // 2, DATA_START - 1, DATA_START, DATA_START + 1, DATA_START + 3,
            (DATA_START + len(BASE)) // 2, len(BASE) - 4, len(BASE) - 1):
    case(f"truncated to {cut} of {len(BASE)} bytes", BASE[:cut], "header")
case("trailing garbage after the data", BASE + b"\xff" * 64, None)

# --- header bit flips (the 8 length bytes and the JSON) ------------------------------------------------------------
for i in range(48):
    position, bit = i * DATA_START // 48, (i * 3) % 8
    case(f"header bit flip at byte {position} bit {bit}",
         lambda p=position, b=bit: BASE[:p] + bytes([BASE[p] ^ (1 << b)]) + BASE[p + 1:], None)


# --- data bit flips: the official decoder of the same bytes says which tensors turn NaN/Inf -------------------------
def data_flip_maker(position: int, bit: int) -> Maker:
    def make(folder: Path, _outside: Path) -> Case:
        data = BASE[:position] + bytes([BASE[position] ^ (1 << bit)]) + BASE[position + 1:]
        bad = [k for k, t in st_load(data).items() if not bool(torch.isfinite(t).all())]
        return Case(write(folder, "case.safetensors", data), "load" if bad else "never", bad[0] if bad else None)
    return make


_header, _ = split(BASE)
ALPHA_AT = DATA_START + _header[ALPHA]["data_offsets"][0]
for name, position, bit in [("alpha exponent → Inf", ALPHA_AT + 3, 6), ("alpha sign", ALPHA_AT + 3, 7),
                            ("alpha mantissa", ALPHA_AT, 0), ("alpha top exponent bit", ALPHA_AT + 2, 7)]:
    CASES[f"data bit flip: {name}"] = data_flip_maker(position, bit)
for i in range(28):
    position = DATA_START + i * (len(BASE) - DATA_START) // 28
    # bit 6/7 of a float32's last byte are its sign and top exponent bit: flips there make huge values or Inf/NaN
    bit = (6, 7, 2, 6)[i % 4] if position % 4 == 3 else i % 8
    CASES[f"data bit flip at byte {position} bit {bit}"] = data_flip_maker(position, bit)
for key in (UP, DOWN):
    begin = DATA_START + _header[key]["data_offsets"][0]
    CASES[f"data: exponent of {key.rsplit('.', 2)[-2]}[0] all ones (Inf/NaN)"] = (
        lambda folder, _o, b=begin, k=key: Case(write(folder, "case.safetensors", BASE[:b + 2] + b"\x80\x7f"
                                                      + BASE[b + 4:]), "load", k))

# --- header length -------------------------------------------------------------------------------------------------
for label, length in [("0", 0), ("1", 1), ("2**63-1", 2**63 - 1), ("2**64-1", 2**64 - 1), ("100 MiB + 1", 100 * 2**20 + 1),
                      ("file size", len(BASE)), ("file size - 7", len(BASE) - 7), ("one long", HEADER_LEN + 1)]:
    case(f"header length {label}", lambda n=length: struct.pack("<Q", n) + BASE[8:], "header")
# one short drops a padding space: the header still parses, every tensor starts a byte early
case("header length one short", struct.pack("<Q", HEADER_LEN - 1) + BASE[8:], None)
case("header length past end with a tiny file", struct.pack("<Q", 1 << 20) + b"{}", "header")
case("header declares 20 MiB of spaces and has them", lambda: join(b"{" + b" " * (20 * 2**20) + b"}"), "load")


# --- tensor entries: offsets ---------------------------------------------------------------------------------------
def with_entry(key: str, **fields) -> Callable[[], bytes]:
    return lambda: edited(entry_edit(key, **fields))


UP_BEGIN, UP_END = _header[UP]["data_offsets"]
for label, offsets in [("negative begin", [-4, UP_END]), ("begin after end", [UP_END, UP_BEGIN]),
                       ("end past the file", [UP_BEGIN, UP_END + 10_000]), ("2**64 end", [UP_BEGIN, 2**64]),
                       ("10**30 end", [UP_BEGIN, 10**30]), ("5000-digit end", None),
                       ("float offsets", [float(UP_BEGIN), float(UP_END)]), ("1.5 offsets", [0.5, UP_END + 0.5]),
                       ("string offsets", [str(UP_BEGIN), str(UP_END)]), ("three offsets", [UP_BEGIN, UP_END, 9]),
                       ("one offset", [UP_BEGIN]), ("no offsets", []), ("offsets null", None),
                       ("offsets an object", {"a": 1}), ("nested offsets", [[UP_BEGIN], [UP_END]]),
                       ("bool offsets", [False, True]), ("shifted by one byte", [UP_BEGIN + 1, UP_END + 1]),
                       ("overlapping the next tensor", [UP_BEGIN + 4, UP_END + 4])]:
    if label == "5000-digit end":
        case(f"offsets: {label}", lambda: edited_text(f"[{UP_BEGIN}, {UP_END}]", f"[{UP_BEGIN}, {'9' * 5000}]"),
             "header")
        continue
    case(f"offsets: {label}", with_entry(UP, data_offsets=offsets), None if "shifted" in label else "header")
case("offsets: missing field", lambda: edited(lambda h: h[UP].pop("data_offsets")), "header", UP)
case("offsets: every tensor at 0", lambda: edited(lambda h: [e.update(data_offsets=[0, e["data_offsets"][1]
                                                                                     - e["data_offsets"][0]])
                                                             for k, e in h.items() if k != "__metadata__"]), "header")

# --- dtypes --------------------------------------------------------------------------------------------------------
for dtype in ("F4", "", "f32", "FLOAT32", "U64", "U32", "U16", "I4", "F8_E8M0", "C64", "F6_E2M3", "X" * 5000):
    case(f"dtype {dtype[:12]!r}", with_entry(UP, dtype=dtype), "header", UP)
for label, dtype in (("null", None), ("number", 32), ("list", ["F32"]), ("object", {"F32": 1})):
    case(f"dtype {label}", with_entry(UP, dtype=dtype), "header", UP)
case("dtype missing", lambda: edited(lambda h: h[UP].pop("dtype")), "header", UP)
for label, dtype, size in (("F16 with F32's byte count", "F16", 4), ("I32 factors", "I32", 4), ("U8 factors", "U8", 1),
                           ("BOOL factors", "BOOL", 1), ("F64 with half the bytes", "F64", 8),
                           ("F8_E4M3 factors", "F8_E4M3", 1), ("I64 alpha", "I64", 8)):
    key = ALPHA if "alpha" in label else UP
    shape = [] if key == ALPHA else [320, RANK]
    numel = math.prod(shape)

    def dtype_case(k=key, d=dtype, s=size, n=numel, sh=shape):
        header, data = split(BASE)
        begin = header[k]["data_offsets"][0]
        old = header[k]["data_offsets"][1] - begin
        body = data[:begin] + bytes(n * s) + data[begin + old:]
        shift = n * s - old
        for other, e in header.items():
            if other != "__metadata__" and e["data_offsets"][0] > begin:
                e["data_offsets"] = [e["data_offsets"][0] + shift, e["data_offsets"][1] + shift]
        header[k].update(dtype=d, shape=sh, data_offsets=[begin, begin + n * s])
        return join(header, body)
    case(f"dtype: {label}", dtype_case, None)

# --- shapes --------------------------------------------------------------------------------------------------------
for label, shape, refused in [("negative", [-320, -RANK], "header"), ("1e400 (float overflow)", "1e400", "header"),
                              ("-1e400", "-1e400", "header"), ("NaN", "NaN", "header"), ("float 1.5", [320.5, RANK], None),
                              ("string", ["320", "2"], None), ("nested", [[320], [RANK]], "header"),
                              ("null", None, "header"), ("object", {"a": 320}, "header"), ("bool", [True, 640], None),
                              ("2**64", [2**64, 0], "header"), ("5000-digit", "digits", "header"),
                              ("huge with a zero", [2**62, 2**62, 0], None), ("2**40 × 0", [2**40, 0], None),
                              ("too many bytes", [320, RANK + 1], "header"), ("transposed", [RANK, 320], None),
                              ("flattened", [640], "load"), ("extra 1 dims", [320, RANK, 1, 1], None),
                              ("50 dims of 1", [1] * 48 + [320, RANK], None), ("empty (scalar of 640)", [], "header")]:
    if shape in ("1e400", "-1e400", "NaN", "digits"):
        literal = {"digits": "9" * 5000}.get(shape, shape)
        # a 5000-digit number fails the JSON parse itself, before any key is known
        case(f"shape {label}", lambda lit=literal: edited_text(f"[320, {RANK}]", f"[{lit}, {RANK}]"), "header",
             None if shape == "digits" else UP)
        continue
    case(f"shape {label}", with_entry(UP, shape=shape), refused, UP if refused == "header" else TO_Q)

# --- JSON structure of the header ----------------------------------------------------------------------------------
case("header: 100k-deep array in metadata", lambda: join('{"__metadata__": {"a": ' + "[" * 100_000 + "]" * 100_000
                                                         + "}}"), "header")
case("header: 100k-deep object as an entry", lambda: join('{"' + ALPHA + '": ' + '{"a": ' * 100_000 + "1"
                                                          + "}" * 100_000 + "}"), "header")
case("header: 3000-deep array as the shape", lambda: join('{"' + ALPHA + '": {"dtype": "F32", "shape": '
                                                          + "[" * 3000 + "]" * 3000 + ', "data_offsets": [0, 4]}}',
                                                          bytes(4)), "header")
case("header: deep array at top level", lambda: join("[" * 100_000 + "]" * 100_000), "header")
case("header: top level an array", lambda: join("[]"), "header")
case("header: top level a string", lambda: join('"x"'), "header")
case("header: top level null", lambda: join("null"), "header")
case("header: top level a number", lambda: join("9" * 5000), "header")
case("header: empty object", lambda: join("{}"), "load")
case("header: empty", lambda: join(""), "header")
case("header: not UTF-8", lambda: join(b'{"\xff\xfe": 1}'), "header")
case("header: UTF-8 BOM", lambda: join(b"\xef\xbb\xbf" + json.dumps(split(BASE)[0]).encode(), split(BASE)[1]), None)
case("header: NUL bytes", lambda: join(b"\x00" * 64), "header")
case("header: JSON then garbage", lambda: join(json.dumps(split(BASE)[0]) + "}}garbage", split(BASE)[1]), "header")
case("header: unterminated string", lambda: join('{"a'), "header")
case("header: only metadata", lambda: join({"__metadata__": {"a": "b"}}), "load")
case("header: entry is a number", lambda: join({ALPHA: 5}), "header", ALPHA)
case("header: entry is a list", lambda: join({ALPHA: ["F32", [], [0, 4]]}, bytes(4)), "header", ALPHA)
case("header: entry is null", lambda: join({ALPHA: None}), "header", ALPHA)
case("header: entry with extra fields", lambda: edited(entry_edit(UP, extra=[1] * 10, more={"x": 1})), None)
case("header: __metadata__ twice", lambda: join(json.dumps(split(BASE)[0])[:-1] + ', "__metadata__": {"a": "b"}}',
                                                split(BASE)[1]), None)
for label, value in (("a list", [1, 2]), ("a string", "text"), ("a number", 5), ("true", True), ("deep", None)):
    if label == "deep":
        case("metadata: 50k-deep value in __metadata__", lambda: edited_text(
            "{", '{"__metadata__": {"x": ' + "[" * 50_000 + "]" * 50_000 + "}, "), "header")
        continue
    case(f"__metadata__ is {label}", lambda v=value: edited(lambda h: h.update(__metadata__=v)), "header")
case("__metadata__ null", lambda: edited(lambda h: h.update(__metadata__=None)), None)
for label, value in (("an object", {"a": {"b": [1]}}), ("a list", [1, "x"]), ("a number", 1e308), ("null", None),
                     ("a bool", False), ("5000 digits", "digits")):
    if value == "digits":
        case("metadata value: 5000-digit number", lambda: edited_text("{", '{"__metadata__": {"n": ' + "9" * 5000
                                                                      + "}, "), None)
        continue
    case(f"metadata value: {label}", lambda v=value: edited(lambda h: h.update(__metadata__={"lycoris_config": v,
                                                                                            "software": v})), None)
# a JSON escape of half a UTF-16 pair is valid JSON and no valid text: what the summary shows must still encode
for meta_key in ("modelspec.title", "ss_base_model_version", "modelspec.trigger_phrase", "ss_training_comment"):
    case(f"metadata value: lone surrogate in {meta_key}", lambda k=meta_key: edited_text(
        "{", '{"__metadata__": {"' + k + '": "a\\ud800b"}, '), "never")
case("metadata value: lone surrogate in a tag of ss_tag_frequency", lambda: edited_text(
    "{", '{"__metadata__": {"ss_tag_frequency": "{\\"d\\": {\\"t\\\\udfff\\": 5}}"}, '), "never")
case("metadata key not a string-safe name", lambda: edited(lambda h: h.update(__metadata__={"\x00\ud800": "x"})), None)

# --- huge keys, many keys ------------------------------------------------------------------------------------------
case("1 MB key name (corrupt entry)", lambda: join({"lycoris_" + "k" * 1_000_000: {"dtype": "F32", "shape": "x"}}),
     "header", "lycoris_kkkk")
case("1 MB key name (valid tensor, unknown key)", lambda: base_bytes(tensors={**base_tensors(), "k" * 1_000_000:
                                                                              torch.ones(1)}), None)
case("1 MB module prefix (valid LoRA, fits nothing)", lambda: base_bytes(tensors={
    "p" * 1_000_000 + ".lora_up.weight": torch.ones(4, 1), "p" * 1_000_000 + ".lora_down.weight": torch.ones(1, 4)}),
    None)
case("5k tiny unknown tensors", lambda: base_bytes(tensors={**base_tensors(),
                                                             **{f"junk_{i}": torch.ones(1) for i in range(5_000)}}),
     None)
case("5k tiny LoRA modules (fit nothing)", lambda: base_bytes(tensors={
    f"m{i}.{part}": torch.ones(1, 1) for i in range(2_500) for part in ("lora_up.weight", "lora_down.weight")}), None)
case("empty key name", lambda: edited(lambda h: h.update({"": h.pop(ALPHA)})), None)
case("key with a NUL and newlines", lambda: edited(lambda h: h.update({"a\x00\n\r.alpha": h.pop(ALPHA)})), None)
case("key with a lone surrogate", lambda: join(json.dumps(split(BASE)[0]).replace(TO_Q + ".alpha",
                                                                                   "x\\ud800.alpha"), split(BASE)[1]),
     None)
case("key with a lone surrogate in a bad entry", lambda: join(b'{"bad\\udfff.alpha": {"dtype": "F32", "shape": 7}}'),
     "header", "bad")
case("two keys meaning the same factor", lambda: base_bytes(tensors={**base_tensors(),
                                                                     f"{TO_Q}.lora_A.weight": torch.ones(RANK, 320)}),
     "load", TO_Q)

# --- NaN / Inf: refused naming file and key ------------------------------------------------------------------------
for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
    for value in ("nan", "inf", "-inf"):
        if dtype == torch.float8_e4m3fn and value != "nan":
            continue  # e4m3fn has no Inf
        for key in (UP, DOWN, ALPHA):
            if key == ALPHA and dtype not in (torch.float32, torch.float16):
                continue

            def bad(d=dtype, v=value, k=key):
                tensors = base_tensors()
                tensor = tensors[k].clone()
                tensor.reshape(-1)[-1] = float(v)
                tensors[k] = tensor.to(d)
                return base_bytes(tensors=tensors)
            case(f"{value} in {key.rsplit('.', 2)[-2] if key != ALPHA else 'alpha'} ({str(dtype)[6:]})", bad, "load",
                 key)
case("NaN in a tensor of an unknown key", lambda: base_bytes(tensors={**base_tensors(),
                                                                      "other.weight": torch.tensor([float("nan")])}),
     "load", "other.weight")
case("NaN in dora_scale", lambda: base_bytes(tensors={**base_tensors(),
                                                      f"{TO_Q}.dora_scale": torch.full((320, 1), float("nan"))}),
     "load", f"{TO_Q}.dora_scale")

# --- zero-size and scalar tensors ----------------------------------------------------------------------------------
for label, changes, refused, key in [
    ("zero-size alpha", {ALPHA: torch.ones(0)}, "load", ALPHA),
    ("zero-size alpha (0, 1)", {ALPHA: torch.ones(0, 1)}, "load", ALPHA),
    ("alpha of 2 values", {ALPHA: torch.ones(2)}, "load", ALPHA),
    ("alpha 2-D (1, 1)", {ALPHA: torch.ones(1, 1)}, None, None),
    ("scalar lora_down", {DOWN: torch.tensor(0.5)}, "load", TO_Q),
    ("scalar lora_up", {UP: torch.tensor(0.5)}, "load", TO_Q),
    ("scalar lora_up and lora_down", {UP: torch.tensor(0.5), DOWN: torch.tensor(0.5)}, "load", TO_Q),
    ("rank 0 factors", {UP: torch.ones(320, 0), DOWN: torch.ones(0, 320)}, None, TO_Q),
    ("zero-size lora_up", {UP: torch.ones(0, RANK)}, None, TO_Q),
    ("zero-size lora_down", {DOWN: torch.ones(RANK, 0)}, None, TO_Q),
    ("1-D factors", {UP: torch.ones(320), DOWN: torch.ones(320)}, "load", TO_Q),
    ("mismatched ranks", {UP: torch.ones(320, 3)}, "load", TO_Q),
    ("scalar dora_scale", {f"{TO_Q}.dora_scale": torch.tensor(1.0)}, "load", TO_Q),
    ("zero-size dora_scale", {f"{TO_Q}.dora_scale": torch.ones(0)}, None, TO_Q),
    ("scalar lora_mid", {f"{TO_Q}.lora_mid.weight": torch.tensor(1.0)}, "load", TO_Q),
    ("zero-size row_offset", {"k.lokr_w1": torch.ones(1, 1), "k.lokr_w2": torch.ones(8, 8),
                              "k.row_offset": torch.ones(0)}, "load", "k.row_offset"),
    ("row_offset 2.5", {"k.lokr_w1": torch.ones(1, 1), "k.lokr_w2": torch.ones(8, 8),
                        "k.row_offset": torch.tensor(2.5)}, "load", "k.row_offset"),
    ("row_offset of 2 values", {"k.lokr_w1": torch.ones(1, 1), "k.lokr_w2": torch.ones(8, 8),
                                "k.row_offset": torch.ones(2)}, "load", "k.row_offset"),
    # shapes each algorithm's layout once indexed before checking (IndexError, RuntimeError escaped)
    ("scalar oft_diag", {"k.oft_diag": torch.tensor(1.0)}, "load", "k.oft_diag"),
    ("scalar GLoRA a1", {"k.a1.weight": torch.tensor(1.0), "k.a2.weight": torch.ones(2, 4),
                         "k.b1.weight": torch.ones(4, 2), "k.b2.weight": torch.ones(2, 4)}, "load", "k.a1.weight"),
    ("zero-size 1-D GLoRA a2", {"k.a1.weight": torch.ones(4, 2), "k.a2.weight": torch.ones(0),
                                "k.b1.weight": torch.ones(4, 2), "k.b2.weight": torch.ones(2, 4)}, "load", "k.a2.weight"),
    ("scalar LoKr t2", {"k.lokr_w1": torch.ones(2, 2), "k.lokr_w2_a": torch.ones(2, 2), "k.lokr_w2_b": torch.ones(2, 2),
                        "k.lokr_t2": torch.tensor(1.0)}, "load", "k.lokr_t2"),
    ("on_input of 2×4 values", {"k.weight": torch.ones(4), "k.on_input": torch.ones(2, 4)}, "load", "k.on_input"),
    ("zero-size on_input", {"k.weight": torch.ones(4), "k.on_input": torch.ones(0)}, "load", "k.on_input"),
    ("zero-size PEFT OFT option", {"k.oft_R.weight": torch.ones(2, 3), "k.peft_option.coft": torch.ones(0)}, "load",
     "k.peft_option.coft"),
    # a file may hold PEFT's options itself (they win over the config's): the summary must read them as scalars
    ("PEFT OFT option held in the file", {"k.oft_R.weight": torch.ones(2, 3), "k.peft_option.coft": torch.tensor(1.0)},
     None, None),
    ("scalar on_input with a 0-d ia3 weight", {"x.weight": torch.tensor(1.0), "x.on_input": torch.tensor(1.0)},
     None, None),
    ("every tensor zero-size", {UP: torch.ones(0, 0), DOWN: torch.ones(0, 0), ALPHA: torch.ones(0)}, "load", TO_Q),
]:
    def shaped(c=changes):
        return base_bytes(tensors={**base_tensors(), **c})
    case(f"tensor: {label}", shaped, refused, key)
case("only an alpha", lambda: base_bytes(tensors={ALPHA: torch.tensor(1.0)}), "load")
case("only unknown keys", lambda: base_bytes(tensors={"a.b": torch.ones(2), "c": torch.ones(1)}), "load")
case("no tensors at all", lambda: base_bytes(tensors={}), "load")
# the summary reads these scalars' values (no check_values there): a NaN/Inf one is a damaged module, not a crash
for option, value in (("num_cayley_neumann_terms", "nan"), ("num_cayley_neumann_terms", "inf"), ("eps", "nan")):
    case(f"{value} PEFT OFT option {option} held in the file", lambda o=option, v=value: base_bytes(tensors={
        **base_tensors(), "k.oft_R.weight": torch.ones(2, 3), f"k.peft_option.{o}": torch.tensor(float(v))}), "load",
         f"k.peft_option.{option}")
case("only module configs", lambda: base_bytes(tensors={
    f"{TO_Q}.config": torch.tensor(list(b'{"a": 1}'), dtype=torch.uint8), "x.config": torch.ones(2)}), "load")


# --- damaged modules among others: the loader names the first, the summary reports each (issue #37) ----------------
def mismatched(prefix: str) -> dict[str, torch.Tensor]:
    """A LoRA module whose factors disagree on the rank."""
    return {f"{prefix}.lora_up.weight": torch.ones(4, 3), f"{prefix}.lora_down.weight": torch.ones(2, 4)}


def beside_base(extra: Callable[[], dict[str, torch.Tensor]]) -> Callable[[], bytes]:
    return lambda: base_bytes(tensors={**base_tensors(), **extra()})


case("modules: a damaged module after a good one", beside_base(lambda: mismatched("lora_unet_z_bad")), "load",
     "lora_unet_z_bad.lora_up.weight")
case("modules: damaged modules before and after a good one",
     lambda: base_bytes(tensors={**mismatched("lora_unet_a_bad"), **base_tensors(), **mismatched("lora_unet_z_bad")}),
     "load", "lora_unet_a_bad.lora_up.weight")
case("modules: dora_scale and lora_magnitude_vector on one module", beside_base(lambda: {
    f"{TO_Q}.dora_scale": torch.ones(320, 1), f"{TO_Q}.lora_magnitude_vector": torch.ones(320)}), "load",
     f"{TO_Q}.lora_magnitude_vector")
case("modules: PEFT's OFT from before 0.16 beside a LoRA", beside_base(lambda: {
    "base_model.model.x.oft_r": torch.ones(2, 3, 3), "base_model.model.x.oft_s": torch.ones(6, 1)}), "load",
     "base_model.model.x.oft_r")
case("modules: PEFT DoRA on an embedding beside a LoRA", beside_base(lambda: {
    "text_encoder.emb.lora_embedding_A": torch.ones(2, 10), "text_encoder.emb.lora_embedding_B": torch.ones(4, 2),
    "text_encoder.emb.lora_magnitude_vector": torch.ones(4)}), "load", "text_encoder.emb.lora_magnitude_vector")
case("modules: NaN alpha on a good module after a damaged one", lambda: base_bytes(tensors={
    **mismatched("lora_unet_a_bad"), **base_tensors(), ALPHA: torch.tensor(float("nan"))}), "load", ALPHA)


# --- symlinks ------------------------------------------------------------------------------------------------------
def _secret_text() -> bytes:
    return b"s3cr3t-outside:" + b"0123456789abcdef" * 4 + b"\n"


@maker("symlink inside the folder to a valid file")
def _inside_valid(folder: Path, _outside: Path) -> Case:
    (folder / "sub").mkdir()
    target = write(folder / "sub", "real.safetensors", BASE)
    (folder / "case.safetensors").symlink_to(target)
    return Case(folder / "case.safetensors", "never")


@maker("symlink inside the folder to a truncated file")
def _inside_truncated(folder: Path, _outside: Path) -> Case:
    write(folder, "real.safetensors", BASE[:100])
    (folder / "case.safetensors").symlink_to("real.safetensors")
    return Case(folder / "case.safetensors", "header")


@maker("symlink outside to a valid file (ComfyUI follows links)")
def _outside_valid(folder: Path, outside: Path) -> Case:
    (folder / "case.safetensors").symlink_to(write(outside, "valid.safetensors", BASE))
    return Case(folder / "case.safetensors", "never")


@maker("symlink outside to /etc/passwd")
def _passwd(folder: Path, _outside: Path) -> Case:
    (folder / "case.safetensors").symlink_to("/etc/passwd")
    return Case(folder / "case.safetensors", "header", secret=Path("/etc/passwd").read_bytes())


@maker("symlink outside to a secret text file")
def _secret(folder: Path, outside: Path) -> Case:
    (folder / "case.safetensors").symlink_to(write(outside, "secret.txt", _secret_text()))
    return Case(folder / "case.safetensors", "header", secret=_secret_text())


@maker("symlink outside to a file whose first 8 bytes are a small header length")
def _secret_small_length(folder: Path, outside: Path) -> Case:
    secret = b"\x40\x00\x00\x00\x00\x00\x00\x00" + b'{"sekrit_value_xyz": {"dtype": "hunter2-password-0987"}}' * 2
    (folder / "case.safetensors").symlink_to(write(outside, "secret.bin", secret))
    return Case(folder / "case.safetensors", "header", secret=secret[8:])


@maker("symlink outside to a file with a secret in a corrupt entry's fields")
def _secret_entry(folder: Path, outside: Path) -> Case:
    secret = b"hunter2-password-0987"
    header = {"lycoris_x.alpha": {"dtype": secret.decode(), "shape": [1], "data_offsets": [0, 4]}}
    (folder / "case.safetensors").symlink_to(write(outside, "secret.safetensors", join(header, bytes(4))))
    return Case(folder / "case.safetensors", "header", secret=secret)


@maker("dangling symlink")
def _dangling(folder: Path, outside: Path) -> Case:
    (folder / "case.safetensors").symlink_to(outside / "missing.safetensors")
    return Case(folder / "case.safetensors", "header")


@maker("symlink loop")
def _loop(folder: Path, _outside: Path) -> Case:
    (folder / "case.safetensors").symlink_to("loop2.safetensors")
    (folder / "loop2.safetensors").symlink_to("case.safetensors")
    return Case(folder / "case.safetensors", "header")


@maker("symlink to /dev/zero")
def _dev_zero(folder: Path, _outside: Path) -> Case:
    (folder / "case.safetensors").symlink_to("/dev/zero")
    return Case(folder / "case.safetensors", "header")


@maker("a directory named .safetensors")
def _directory(folder: Path, _outside: Path) -> Case:
    (folder / "case.safetensors").mkdir()
    return Case(folder / "case.safetensors", "header")


@maker("a FIFO")
def _fifo(folder: Path, _outside: Path) -> Case:
    os.mkfifo(folder / "case.safetensors")
    return Case(folder / "case.safetensors", "header", fifo=True)


@maker("symlink to a FIFO outside")
def _fifo_link(folder: Path, outside: Path) -> Case:
    os.mkfifo(outside / "pipe")
    (folder / "case.safetensors").symlink_to(outside / "pipe")
    return Case(folder / "case.safetensors", "header", fifo=True)


# --- pickles: refused, never unpickled -----------------------------------------------------------------------------
class _Marker:
    """Unpickling this creates its marker file (what a hostile checkpoint would do, harmlessly)."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def pickle_maker(suffix: str, how: str) -> Maker:
    def make(folder: Path, outside: Path) -> Case:
        marker = outside / "unpickled"
        if how == "torch.save":
            path = folder / f"case{suffix}"
            torch.save({"x.alpha": torch.ones(1), "evil": _Marker(marker)}, path)
        else:
            path = write(folder, f"case{suffix}", pickle.dumps(_Marker(marker), protocol=int(how)))
        assert not marker.exists()
        return Case(path, "header", marker=marker)
    return make


for suffix in (".ckpt", ".pt", ".pth", ".bin", ".pkl", ".PT", ".safetensors"):
    for how in ("torch.save", "2", "5"):
        CASES[f"pickle ({how}) as {suffix}"] = pickle_maker(suffix, how)


# --- running a case ------------------------------------------------------------------------------------------------

def _outcome(read: Callable, path: Path):
    """(result, None) or (None, the LycorisError); any other exception fails the test as it is."""
    try:
        return read(path), None
    except LycorisError as error:
        return None, error


def _check_error(case_: Case, error: LycorisError, name: str) -> str:
    message = str(error)
    assert len(message) <= MAX_MESSAGE, f"{len(message)}-character error"
    message.encode("utf-8")  # logs, the UI and JSON responses carry it
    assert name[:MAX_NAME] in message, f"error does not name the file: {message[:300]}"
    if case_.secret is not None:
        assert_no_secret(message, case_.secret)
    return message


def assert_no_secret(message: str, secret: bytes) -> None:
    """No run of 8 bytes of `secret` (nor the numbers its first 8 bytes form as a header length) in `message`."""
    text = message.encode("utf-8", "replace")
    for window in (8, 4):
        numbers = {str(int.from_bytes(secret[:window], "little")), str(int.from_bytes(secret[:window], "big")),
                   secret[:window].hex()}
        assert not [n for n in numbers if n in message], f"error shows the first {window} bytes: {message[:300]}"
    leaks = [secret[i:i + 8] for i in range(max(len(secret) - 7, 0)) if secret[i:i + 8] in text]
    assert not leaks, f"error shows bytes of a file outside the folder: {leaks[:3]} in {message[:300]}"


def _with_fifo_watchdog(path: Path, read: Callable):
    """Call read(path); if it is still blocked in opening a FIFO after 2 s, open the other end to release it (so a
    reader that blocks fails this test instead of hanging CI), and fail."""
    done = threading.Event()
    released = []

    def watch():
        if done.wait(2.0):
            return
        while not done.is_set():
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
                released.append(True)
            except OSError:
                pass
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        return _outcome(read, path)
    finally:
        done.set()
        watcher.join()
        assert not released, f"{getattr(read, '__name__', read)} blocked opening a FIFO"


READERS: dict[str, Callable] = {"SafetensorsFile": SafetensorsFile, "cache.read": cache.read, "summarize": summarize}


def run_readers(case_: Case) -> dict[str, tuple]:
    return {label: _with_fifo_watchdog(case_.path, read) if case_.fifo else _outcome(read, case_.path)
            for label, read in READERS.items()}


def check_case(case_: Case, results: dict[str, tuple]) -> None:
    name = case_.path.name
    for label, (_value, error) in results.items():
        if error is not None:
            _check_error(case_, error, name)
    summary = results["summarize"][0]
    if summary is not None:  # the Info node's STRING outputs and the route's JSON carry it
        summary.text().encode("utf-8")
        ", ".join(summary.trigger_words).encode("utf-8")
        json.dumps(summary.to_json(with_modules=True), ensure_ascii=False).encode("utf-8")
    refusals = {label: error for label, (_value, error) in results.items() if error is not None}
    assert_loader_and_summary_agree(*results["cache.read"], *results["summarize"])  # one parse, two rules (#37)
    if case_.refused == "never":
        assert not refusals, {k: str(v)[:300] for k, v in refusals.items()}
    elif case_.refused == "header":
        assert set(refusals) == set(READERS), f"read by {set(READERS) - set(refusals)}"
    elif case_.refused == "load":
        assert "cache.read" in refusals, "the loader read a file it must refuse"
    if case_.key is not None:
        for label, error in refusals.items():
            if label != "SafetensorsFile" or case_.refused == "header":
                assert case_.key[:MAX_NAME // 2] in str(error), f"{label}: key not named: {str(error)[:300]}"
    if case_.marker is not None:
        assert not case_.marker.exists(), "a pickle was unpickled"


@pytest.fixture()
def outside(tmp_path):
    folder = tmp_path / "outside"
    folder.mkdir()
    return folder


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case_id", list(CASES))
def test_readers(case_id, tmp_path, outside):
    folder = tmp_path / "loras"
    folder.mkdir()
    case_ = CASES[case_id](folder, outside)
    check_case(case_, run_readers(case_))


def test_corpus_is_issue_sized():
    assert len(CASES) >= 257, len(CASES)


# --- through the nodes, on a real model ----------------------------------------------------------------------------
NODE_CASES = [
    "valid base file", "valid: 50k-deep JSON in metadata lycoris_config",
    "valid: 5000-digit number in metadata software", "valid: 5000-digit number in metadata ss_tag_frequency",
    "5000-digit number in metadata lora_adapter_metadata", "50k-deep JSON in metadata lora_adapter_metadata",
    f"truncated to {DATA_START + 1} of {len(BASE)} bytes", f"header bit flip at byte {8 * DATA_START // 48} bit 0",
    f"header bit flip at byte {40 * DATA_START // 48} bit 0", "data bit flip: alpha exponent → Inf",
    "header length 2**64-1", "offsets: end past the file", "dtype 'F4'", "dtype list", "shape 1e400 (float overflow)",
    "shape huge with a zero", "header: 100k-deep array in metadata", "1 MB key name (corrupt entry)",
    "key with a lone surrogate in a bad entry", "nan in lora_up (float32)", "inf in alpha (float16)",
    "nan in lora_down (float8_e4m3fn)", "tensor: zero-size alpha", "tensor: scalar lora_down",
    "tensor: alpha of 2 values", "two keys meaning the same factor", "symlink outside to /etc/passwd",
    "symlink outside to a file with a secret in a corrupt entry's fields",
    "symlink outside to a valid file (ComfyUI follows links)", "pickle (2) as .ckpt",
    "pickle (torch.save) as .safetensors", "metadata value: lone surrogate in modelspec.title",
]


# Structural damage the header shows (no tensor data needed): the Info node's summary names the module (issue #11: a
# scalar lora_down gave "cannot call item() on meta tensors", and the summary reported 0 modules without a word).
DAMAGED_MODULES = ("tensor: scalar lora_down", "tensor: zero-size alpha", "tensor: alpha of 2 values")


@pytest.fixture(scope="module")
def untouched(sd15):
    """The diffusion model's weights (all of them: the files here target it) and the text encoder's first q_proj
    (reading all 123M CLIP-L weights twice per case would cost ~1 s) before any case ran."""
    model, clip = sd15
    return ({k: v.clone() for k, v in model.model.state_dict().items()},
            clip.cond_stage_model.state_dict()[TE_Q_KEY].clone())


def assert_model_unchanged(sd15, untouched) -> None:
    model, clip = sd15
    assert model.patches == {} and clip.patcher.patches == {}, "the input model was given patches"
    after = model.model.state_dict()
    changed = [k for k, v in untouched[0].items() if not torch.equal(after[k], v)]
    assert not changed, f"weights of the input model changed: {changed[:3]}"
    assert torch.equal(clip.cond_stage_model.state_dict()[TE_Q_KEY], untouched[1]), "the text encoder changed"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case_id", NODE_CASES)
def test_loader_and_info_nodes(case_id, sd15, untouched, loras, outside):
    case_ = CASES[case_id](loras, outside)
    model, clip = sd15
    name = case_.path.name
    try:
        new_model, new_clip = execute(LycorisLoader, model=model, clip=clip, lycoris_name=name, strength_model=1.0,
                                      strength_clip=1.0).result
    except LycorisError as error:
        assert case_.refused != "never", f"a valid file was refused: {str(error)[:300]}"
        message = _check_error(case_, error, name)
        if case_.key is not None and case_.refused in ("header", "load"):
            assert case_.key[:MAX_NAME // 2] in message, f"key not named: {message[:300]}"
    else:
        assert case_.refused not in ("header", "load"), "the loader applied a file it must refuse"
        if case_.refused == "never":
            assert TO_Q_KEY in new_model.patches, "a valid file was not applied"
        assert new_model is not model and new_clip is not None
    if case_.marker is not None:
        assert not case_.marker.exists(), "a pickle was unpickled"

    # the Info node: the summary alone, and with the model connected (coverage)
    for inputs in ({}, {"model": model, "clip": clip}):
        try:
            outputs = execute(LycorisInfo, lycoris_name=name, **inputs).result
            summary_text = outputs[0]
        except LycorisError as error:
            assert not (case_.refused == "never" and not inputs), f"the summary refused a valid file: {error}"
            message = _check_error(case_, error, name)
            if inputs and case_.key is not None and case_.refused in ("header", "load"):  # the loader's refusal
                assert case_.key[:MAX_NAME // 2] in message, f"key not named: {message[:300]}"
        else:
            assert case_.refused != "header", "the Info node read a file whose header is broken"
            for text in outputs:  # STRING outputs go on to other nodes, files and logs
                text.encode("utf-8")
            if case_id in DAMAGED_MODULES and not inputs:  # a damaged module is reported, not silently dropped
                assert TO_Q in summary_text, f"summary does not name the damaged module: {summary_text[:500]}"
    assert_model_unchanged(sd15, untouched)
    if case_.marker is not None:
        assert not case_.marker.exists(), "a pickle was unpickled"
