"""Property-based fuzzing (hypothesis) of what a user's file reaches: the safetensors header/metadata parser, module
detection and parsing, the plan/patch of what parses, and the summary.

The property everywhere: an input parses, or raises LycorisError whose text names the file (and the key, where one
key is at fault), is bounded in length and encodes as UTF-8; never another exception type, never a hang. What
parses is then checked against independent truth: tensors against the official `safetensors` decoder of the same
bytes, a module whose plan says it fits a weight must patch it (same shape, no exception).

Fixed budget: derandomized, no example database, `max_examples` per test chosen so the file runs in well under 30 s
on a 2-core CI machine; the same examples run on every machine.
"""

import contextlib
import json
import math
import struct
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lycoris_nodes import lycoris_core
from lycoris_nodes.lycoris_core import LycorisError, SafetensorsFile, parse_state_dict
from lycoris_nodes.lycoris_core.algos import BIAS_ALGORITHMS, WEIGHT_ALGORITHMS
from lycoris_nodes.lycoris_core.errors import MAX_NAME, MAX_REASON
from lycoris_nodes.lycoris_core.keys import ALIASES, ALPHA, DORA_SCALE, PEFT_MAGNITUDE
from lycoris_nodes.lycoris_core.lycoris_file import group_keys
from lycoris_nodes.lycoris_core.module import build_modules
from lycoris_nodes.lycoris_core.patch import apply
from lycoris_nodes.lycoris_core.safetensors_file import DTYPES
from lycoris_nodes.lycoris_core.summary import SCALAR_SUFFIXES, summarize
from parse_agreement import assert_loader_and_summary_agree
from safetensors import SafetensorError, safe_open
from safetensors.torch import save as st_save

MAX_MESSAGE = 2 * MAX_NAME + MAX_REASON + 200
FILE = "fuzz.safetensors"
BUDGET = settings(deadline=None, derandomize=True, database=None, print_blob=True,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                         HealthCheck.large_base_example])


def check_refusal(error: LycorisError, key: str | None = None) -> None:
    message = str(error)
    assert len(message) <= MAX_MESSAGE, f"{len(message)}-character error"
    message.encode("utf-8")  # logs, the UI and JSON responses carry it
    assert FILE in message, f"error does not name the file: {message[:300]}"
    if key is not None:
        assert key[:MAX_NAME // 2] in message, f"error does not name {key[:80]!r}: {message[:300]}"


def outcome(read, *args, **kwargs):
    """(result, None) or (None, LycorisError); any other exception propagates and fails the example."""
    try:
        return read(*args, **kwargs), None
    except LycorisError as error:
        return None, error


# --- strategies: names, shapes, dtypes, JSON -----------------------------------------------------------------------
DTYPE_NAMES = sorted(DTYPES)
PREFIXES = st.sampled_from([
    "lora_unet_down_blocks_0_attentions_0_proj_in", "lycoris_blocks_0_attn_to_q", "lora_te_text_model_encoder_layers_0",
    "base_model.model.blocks.0.attn.to_q", "unet.down_blocks.0.attentions.0.to_k", "transformer.blocks.1.ff.net.0",
    "oft_unet_mid_block_attn", "diffusion_model.input_blocks.1.1.proj_in", "x", "a.b"])
SUFFIXES = sorted({s for a in WEIGHT_ALGORITHMS + BIAS_ALGORITHMS for s in a.markers + a.keys}
                  | set(ALIASES) | {ALPHA, DORA_SCALE, PEFT_MAGNITUDE})
GROUPS = [sorted(set(a.markers + a.keys) | {ALPHA, DORA_SCALE}) for a in WEIGHT_ALGORITHMS + BIAS_ALGORITHMS]
SMALL_DIM = st.one_of(st.integers(1, 6), st.just(0), st.integers(7, 12))
SHAPES = st.lists(SMALL_DIM, min_size=0, max_size=4).map(tuple)
# JSON values as a header can hold them: anything nested, with big and odd numbers
JSON_LEAVES = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                        st.text(max_size=20))
JSON_VALUES = st.recursive(JSON_LEAVES, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                                st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                           max_leaves=12)
# raw JSON texts no encoder writes: deep nesting, 5000-digit numbers, overflowing floats
RAW_JSON = st.sampled_from(["[" * 5000 + "]" * 5000, '{"a": ' * 3000 + "1" + "}" * 3000, "9" * 5000, "-" + "9" * 5000,
                            "1e400", "-1e400", "NaN", "Infinity", "[1e400]", '"\\ud800"', "[" * 200 + "]" * 200])


@st.composite
def metadata(draw) -> dict[str, str]:
    """String metadata as writers store it: plain text, JSON documents, broken and hostile JSON, under the keys the
    pack reads (trainer and config keys) and others."""
    keys = st.sampled_from(["lycoris_config", "software", "ss_tag_frequency", "lora_adapter_metadata", "ss_network_args",
                            "ss_network_module", "ss_base_model_version", "modelspec.trigger_phrase",
                            "modelspec.architecture", "modelspec.title", "ot_revision", "format", "other"])
    values = st.one_of(st.text(max_size=30), JSON_VALUES.map(lambda v: json.dumps(v)), RAW_JSON,
                       st.sampled_from(['{"name": "ai-toolkit"}', "lycoris.kohya", "sdxl", '{"r": 4, "lora_alpha": 8}',
                                        '{"r": 0, "lora_alpha": 1, "use_rslora": true}',
                                        '{"r": 4, "rank_pattern": {"(": 2}, "alpha_pattern": {"x": "y"}}',
                                        '{"a": {"tag": 3, "x": "9"}}']))
    return draw(st.dictionaries(keys, values, max_size=4))


def tensor_of(draw, shape: tuple[int, ...], dtype: torch.dtype, finite: bool = True) -> torch.Tensor:
    """A small tensor of this shape and dtype: random normal values (finite), or raw random bytes (anything)."""
    numel = math.prod(shape)
    if finite or dtype in (torch.bool,) or not dtype.is_floating_point:
        seed = draw(st.integers(0, 2**16))
        values = torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * 0.1
        if dtype == torch.bool:
            return (values > 0).reshape(shape)
        if not dtype.is_floating_point:
            return (values * 10).round().to(dtype).reshape(shape)
        return values.to(dtype).reshape(shape)
    raw = draw(st.binary(min_size=numel * dtype.itemsize, max_size=numel * dtype.itemsize))
    return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape).clone() if numel else torch.empty(shape,
                                                                                                          dtype=dtype)


# --- 1. the header parser on mutated bytes -------------------------------------------------------------------------

@st.composite
def valid_files(draw) -> bytes:
    tensors = {}
    for _ in range(draw(st.integers(1, 4))):
        key = draw(PREFIXES) + "." + draw(st.sampled_from(SUFFIXES))
        dtype = DTYPES[draw(st.sampled_from(DTYPE_NAMES))]
        tensors[key] = tensor_of(draw, draw(SHAPES), dtype, finite=draw(st.booleans()))
    return st_save(tensors, metadata=draw(metadata()) or None)


def _header_of(data: bytes) -> tuple[dict, bytes]:
    n = int.from_bytes(data[:8], "little")
    text = data[8:8 + n]
    # Whether json.loads of deep nesting raises RecursionError depends on the stack depth hypothesis calls us at
    # (generating vs replaying), which makes the data generation flaky: refuse deep nesting the same way every time,
    # counted outside strings (a flipped or inserted byte can break a run of brackets, not the nesting).
    if _nesting(text) > 100:
        raise ValueError("nested too deep to edit")
    return json.loads(text), data[8 + n:]


def _nesting(text: bytes) -> int:
    """The deepest [ / { nesting of a JSON text, outside string literals."""
    depth = deepest = 0
    in_string = escaped = False
    for byte in text:
        if in_string:
            escaped, in_string = (False, True) if escaped else (byte == 0x5C, byte != 0x22)
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):
            depth += 1
            deepest = max(deepest, depth)
        elif byte in (0x5D, 0x7D):
            depth -= 1
    return deepest


def _join(text: str, body: bytes) -> bytes:
    raw = text.encode("utf-8", "surrogatepass")
    return struct.pack("<Q", len(raw)) + raw + body


WEIRD_FIELD = st.one_of(JSON_VALUES, st.sampled_from(["RAW:" + r for r in
                                                      ("1e400", "9" * 5000, "[" * 3000 + "]" * 3000, "NaN",
                                                       "[-1]", "[1.5, 2]", "[[1]]", "[2e19, 0]",
                                                       "[4611686018427387904, 4611686018427387904, 0]", '"F8_E8M0"', '"F4"', "[0, -4]",
                                                       "[18446744073709551615, 18446744073709551616]")]))


NEW_KEYS = ["", "x" * 5000, "a\x00b.alpha", "lora_up.weight", "\ud800.alpha"]
EDIT_TARGETS = ["dtype", "shape", "data_offsets", "entry", "metadata", "metadata value", "key"]


@st.composite
def header_edits(draw) -> tuple:
    """What one header edit does, drawn the same way whatever the header holds (and whether it parses at all):
    a strategy whose draws depend on a parse that can fail one time and not another is flaky by hypothesis' rules."""
    return draw(WEIRD_FIELD), draw(st.sampled_from(EDIT_TARGETS)), draw(st.sampled_from(NEW_KEYS)), \
        draw(st.integers(0, 2**16))


def edited_header(data: bytes, edit: tuple) -> bytes:
    """One entry field, or the metadata, replaced by an odd JSON value (raw texts spliced in as written)."""
    value, target, new_key, pick = edit
    header, body = _header_of(data)
    keys = [k for k in header if k != "__metadata__"]
    raw = value[4:] if isinstance(value, str) and value.startswith("RAW:") else None
    placeholder = "@@RAW@@"
    if target == "metadata":
        header["__metadata__"] = placeholder if raw else value
    elif target == "metadata value":
        header["__metadata__"] = {"k": placeholder if raw else value}
    elif target == "key" and keys:
        header[new_key] = header.pop(keys[0])
    elif keys:
        key = keys[pick % len(keys)]
        if target == "entry" or not isinstance(header[key], dict):  # an earlier edit may have made it a non-object
            header[key] = placeholder if raw else value
        else:
            header[key][target] = placeholder if raw else value
    text = json.dumps(header)
    if raw:
        text = text.replace(json.dumps(placeholder), raw)
    return _join(text, body)


@st.composite
def mutated_files(draw) -> bytes:
    data = draw(valid_files())
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(["flip", "flip", "truncate", "header_len", "insert", "edit", "append"]))
        if kind == "flip" and data:
            position = draw(st.integers(0, len(data) - 1))
            data = data[:position] + bytes([data[position] ^ (1 << draw(st.integers(0, 7)))]) + data[position + 1:]
        elif kind == "truncate":
            data = data[:draw(st.integers(0, len(data)))]
        elif kind == "header_len" and len(data) >= 8:
            length = draw(st.one_of(st.integers(0, 2**64 - 1), st.integers(0, len(data) + 8)))
            data = struct.pack("<Q", length) + data[8:]
        elif kind == "insert":
            position = draw(st.integers(0, len(data)))
            data = data[:position] + draw(st.binary(min_size=1, max_size=16)) + data[position:]
        elif kind == "append":
            data = data + draw(st.binary(max_size=64))
        elif kind == "edit":
            edit = draw(header_edits())
            try:
                data = edited_header(data, edit)
            except (ValueError, UnicodeDecodeError, RecursionError):
                continue  # an earlier mutation broke the JSON: nothing to edit
    return data


def official_tensors(path: Path) -> dict[str, torch.Tensor] | None:
    """The official safetensors decoder's tensors, or None when it refuses the file."""
    try:
        with safe_open(str(path), "pt") as f:
            names = f.keys()  # a safe_open handle is not iterable
            return {k: f.get_tensor(k) for k in names}
    except (SafetensorError, RuntimeError, ValueError, OSError, TypeError):  # its errors are not one type
        return None


@contextlib.contextmanager
def written(data: bytes):
    """`data` as the file FILE in a fresh folder (hypothesis examples cannot use function-scoped tmp_path)."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / FILE
        path.write_bytes(data)
        yield path


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)  # bitwise: NaN payloads and -0.0 compare as stored


@settings(BUDGET, max_examples=600)
@given(data=mutated_files())
def test_header_parser_parses_or_names_the_file(data):
    with written(data) as path:
        reader, error = outcome(SafetensorsFile, path)
        if error is not None:
            check_refusal(error)
            return
        for key, entry in reader.entries.items():  # the layout it vouched for is inside the file
            assert reader._data_start <= entry.start <= entry.end <= reader.size, key
            assert entry.end - entry.start == entry.numel * entry.dtype.itemsize, key
        tensors = {}
        for key in reader.entries:
            tensor, error = outcome(reader.tensor, key)
            if error is not None:
                check_refusal(error, key)
                continue
            assert tuple(tensor.shape) == reader.entries[key].shape and tensor.dtype == reader.entries[key].dtype
            tensors[key] = tensor
        official = official_tensors(path)
        if official is not None:  # where both decoders read the file, they read the same bytes
            for key in tensors.keys() & official:
                assert tensors[key].shape == official[key].shape and tensors[key].dtype == official[key].dtype, key
                assert torch.equal(_bytes_of(tensors[key]), _bytes_of(official[key])), key
        del reader, tensors


@settings(BUDGET, max_examples=400)
@given(data=mutated_files())
def test_loader_and_summary_parse_or_name_the_file(data):
    with written(data) as path:
        readings = {}
        for read in (lycoris_core.load, summarize):
            result, error = outcome(read, path)
            readings[read] = result, error
            if error is not None:
                check_refusal(error)
            elif read is summarize:
                json.dumps(result.to_json(with_modules=True), allow_nan=False)  # what the route and the panel send
                result.text().encode("utf-8")
        assert_loader_and_summary_agree(*readings[lycoris_core.load], *readings[summarize])


# --- 2. detection and parsing on generated key groups --------------------------------------------------------------

@st.composite
def key_groups(draw) -> dict[str, torch.Tensor]:
    """One to three modules: a known algorithm's key set (a random subset with its marker, or a coherent LoRA),
    or random suffixes; random shapes and dtypes."""
    state_dict = {}
    for _ in range(draw(st.integers(1, 3))):
        prefix = draw(PREFIXES)
        style = draw(st.sampled_from(["algorithm", "algorithm", "random", "lora"]))
        if style == "lora":
            out, inn, rank = draw(SMALL_DIM), draw(SMALL_DIM), draw(st.integers(1, 4))
            kernel = draw(st.sampled_from([(), (1, 1), (3, 3)]))
            names = draw(st.sampled_from([("lora_up.weight", "lora_down.weight"), ("lora_B.weight", "lora_A.weight"),
                                          ("lora.up.weight", "lora.down.weight")]))
            state_dict[f"{prefix}.{names[0]}"] = tensor_of(draw, (out, rank) + (1,) * len(kernel), torch.float32)
            state_dict[f"{prefix}.{names[1]}"] = tensor_of(draw, (rank, inn) + kernel, torch.float32)
            if draw(st.booleans()):
                state_dict[f"{prefix}.alpha"] = tensor_of(draw, draw(st.sampled_from([(), (1,), (0,), (2,)])),
                                                          torch.float32)
            continue
        if style == "algorithm":
            suffixes = draw(st.lists(st.sampled_from(draw(st.sampled_from(GROUPS))), min_size=1, max_size=6,
                                     unique=True))
        else:
            suffixes = draw(st.lists(st.sampled_from(SUFFIXES), min_size=1, max_size=4, unique=True))
        for suffix in suffixes:
            dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float32, torch.int64,
                                          torch.bool, torch.float8_e4m3fn]))
            state_dict[f"{prefix}.{suffix}"] = tensor_of(draw, draw(SHAPES), dtype)
    return state_dict


def weight_shapes(module) -> list[tuple[int, ...]]:
    """The weight shapes a module's layout names, and a few it does not."""
    layout = module.layout
    shapes = [(3, 4), (layout.out, 5)]
    if layout.shape is not None:
        shapes.append(tuple(layout.shape))
    if layout.flat_in:
        shapes += [(layout.out, layout.flat_in), (layout.out, layout.flat_in, 1, 1)]
    return [s for s in shapes if all(d > 0 for d in s) and math.prod(s) <= 1 << 16]  # models have no empty weights


@settings(BUDGET, max_examples=400)
@given(state_dict=key_groups(), meta=metadata(), strength=st.sampled_from([1.0, 0.5, -1.0]))
def test_detection_parses_or_names_file_and_key(state_dict, meta, strength):
    parsed, error = outcome(parse_state_dict, state_dict, FILE, meta)
    if error is not None:
        check_refusal(error)
        return
    for name, module in parsed.modules.items():
        for shape in weight_shapes(module):
            plan, error = outcome(module.plan_for, shape, file=FILE)
            if error is not None:
                check_refusal(error, module.prefix)
                continue
            weight = torch.randn(shape, generator=torch.Generator().manual_seed(0))
            patched = apply(plan, module.tensors, weight.clone(), strength)  # a plan that fits must patch
            assert patched.shape == weight.shape, name


@settings(BUDGET, max_examples=400)
@given(state_dict=key_groups())
def test_detection_on_meta_tensors_agrees_with_real_ones(state_dict):
    """The summary parses modules on meta tensors (shapes only; one-element scalars it reads, SCALAR_SUFFIXES,
    real): every group parses or refuses the same way as on the real tensors, and never raises anything else."""
    grouped, error = outcome(group_keys, state_dict, FILE)
    if error is not None:
        check_refusal(error)
        return
    for prefix, group in grouped[0].items():
        real, real_error = outcome(build_modules, prefix, group, FILE)
        shaped = {k: (t if t.numel() <= 1 and k.endswith(SCALAR_SUFFIXES)
                      else torch.empty(t.shape, dtype=t.dtype, device="meta")) for k, t in group.items()}
        meta, meta_error = outcome(build_modules, prefix, shaped, FILE)
        for error in (real_error, meta_error):
            if error is not None:
                check_refusal(error, prefix)
        assert (real_error is None) == (meta_error is None), (str(real_error), str(meta_error))
        if real is not None:
            assert [m.label for m in real[0]] == [m.label for m in meta[0]]
            assert [m.layout for m in real[0]] == [m.layout for m in meta[0]]


# --- 3. the summary of generated files -----------------------------------------------------------------------------

@settings(BUDGET, max_examples=250)
@given(state_dict=key_groups(), meta=metadata())
def test_summary_reads_or_names_the_file(state_dict, meta):
    with written(st_save({k: v.contiguous() for k, v in state_dict.items()}, metadata=meta or None)) as path:
        summary, error = outcome(summarize, path)
        if error is not None:
            check_refusal(error)
        else:
            json.dumps(summary.to_json(with_modules=True), allow_nan=False)  # NaN/Infinity are not JSON
            summary.text().encode("utf-8")
        parsed, load_error = outcome(lycoris_core.load, path)
        if load_error is not None:
            check_refusal(load_error)
        # one parse, two rules (#37): what loads, the summary reads alike; a module the loader refuses, it reports
        assert_loader_and_summary_agree(parsed, load_error, summary, error)


pytestmark = pytest.mark.timeout(120)
