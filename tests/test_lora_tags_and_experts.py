"""Issue #36's two readers of names: `<lora:...>` tags (nodes/loading/lora_tags.py) and Wan 2.2's HIGH/LOW pairs
(nodes/loading/experts.py). Tables of the names people write and share, each with what it must resolve to."""

from __future__ import annotations

import pytest
from lycoris_nodes.lycoris_core import LycorisError
from lycoris_nodes.nodes.loading.experts import HIGH, LOW, find_pair, metadata_expert
from lycoris_nodes.nodes.loading.lora_tags import parse_tags

LISTED = [
    "style.safetensors",
    "wan/motion.safetensors",
    "wan/style.v2.safetensors",
    "a/dup.safetensors",
    "b/dup.safetensors",
    "b/dup.ckpt",
    "with space.safetensors",
]

# text -> [(listed name, strength_model, strength_clip)]
TAGS = [
    ("<lora:style:0.8>", [("style.safetensors", 0.8, 0.8)]),
    ("<lora:style>", [("style.safetensors", 1.0, 1.0)]),
    ("<lora:style:0.8:0.3>", [("style.safetensors", 0.8, 0.3)]),
    ("<LORA:style:-1>", [("style.safetensors", -1.0, -1.0)]),
    ("<lyco:motion:0.5>", [("wan/motion.safetensors", 0.5, 0.5)]),
    ("<lora:wan/motion.safetensors:1.2>", [("wan/motion.safetensors", 1.2, 1.2)]),
    ("<lora:wan\\motion:1>", [("wan/motion.safetensors", 1.0, 1.0)]),  # a name saved on Windows
    ("<lora:style.v2:0.7>", [("wan/style.v2.safetensors", 0.7, 0.7)]),
    ("<lora:a/dup:1>", [("a/dup.safetensors", 1.0, 1.0)]),
    ("<lora:b/dup.ckpt:1>", [("b/dup.ckpt", 1.0, 1.0)]),
    ("<lora:with space:.5>", [("with space.safetensors", 0.5, 0.5)]),
    ("a cat, <lora:style:0.8> sitting, <lora:motion:0.6:0>, 4k", [("style.safetensors", 0.8, 0.8),
                                                                   ("wan/motion.safetensors", 0.6, 0.0)]),
    ("no tags here, <not a tag>", []),
    ("", []),
]


@pytest.mark.parametrize(("text", "want"), TAGS)
def test_a_tag_names_a_listed_file_and_its_strengths(text, want):
    got = [(t.name, t.strength_model, t.strength_clip) for t in parse_tags(text, LISTED)]
    assert got == want


BAD_TAGS = [
    ("<lora:style:strong>", "'strong' is not a strength in <lora:style:strong>"),
    ("<lora:style:1:2:3>", "<lora:style:1:2:3> has 3 strengths"),
    ("<lora:style:0.8", "'<lora:style:0.8' is not a tag"),
    ("<lora:style:>", "'' is not a strength in <lora:style:>"),
    ("<lora:missing:1>", "<lora:missing:1>: no file 'missing' in the loras folders"),
    ("<lora:dup:1>", "<lora:dup:1> names 3 files: a/dup.safetensors, b/dup.ckpt, b/dup.safetensors"),
    ("ok <lora:style:1> then <lora:sty\nle:1>", "'<lora:sty' is not a tag"),
]


@pytest.mark.parametrize(("text", "message"), BAD_TAGS)
def test_a_bad_tag_is_refused_naming_the_fragment(text, message):
    with pytest.raises(LycorisError) as err:
        parse_tags(text, LISTED)
    assert message in str(err.value)


# The pairs as the files are named where people get them, each half given and the other found.
PAIRS = [
    ("Wan2.2-Lightning_I2V-A14B-4steps-lora_HIGH_fp16.safetensors",
     "Wan2.2-Lightning_I2V-A14B-4steps-lora_LOW_fp16.safetensors", "HIGH / LOW"),
    ("wan2.2_i2v_lightx2v_4steps_lora_v1_high_noise.safetensors",
     "wan2.2_i2v_lightx2v_4steps_lora_v1_low_noise.safetensors", "high_noise / low_noise"),
    ("wan22-style-HighNoise.safetensors", "wan22-style-LowNoise.safetensors", "high_noise / low_noise"),
    ("video/high_noise_model/motion.safetensors", "video/low_noise_model/motion.safetensors", "high_noise / low_noise"),
    ("rCM-HIGH-strength1.5.safetensors", "rCM-LOW-strength1.0.safetensors", "HIGH / LOW"),  # numbers differ
    ("dance_HN_e12.safetensors", "dance_LN_e12.safetensors", "HN / LN"),
    ("Dance High v1.safetensors", "Dance Low v1.safetensors", "HIGH / LOW"),
]


@pytest.mark.parametrize(("high", "low", "rule"), PAIRS)
def test_either_half_of_a_pair_finds_the_other(high, low, rule):
    listed = [high, low, "unrelated.safetensors", "highlights_LOW_light.safetensors"]
    for picked, expert in ((high, HIGH), (low, LOW)):
        pair = find_pair(picked, listed)
        assert (pair.high, pair.low, pair.expert, pair.rule) == (high, low, expert, rule), picked


@pytest.mark.parametrize("name", [
    "style.safetensors",
    "highlights.safetensors",  # a word that starts with "high" names no expert
    "HighResFix.safetensors",
    "hn.and.ln.safetensors",  # both words: not a pair's half
    "sky_lowres.safetensors",
])
def test_a_name_without_an_experts_word_is_no_half(name):
    assert find_pair(name, [name]) is None


def test_a_half_without_its_sibling_says_which_name_it_looked_for():
    pair = find_pair("motion_HIGH.safetensors", ["motion_HIGH.safetensors", "other_LOW.safetensors"])
    assert (pair.high, pair.low, pair.sibling) == ("motion_HIGH.safetensors", None, None)
    assert pair.sibling_name == "motion_LOW.safetensors"


def test_two_loose_siblings_are_none_rather_than_a_guess():
    listed = ["m-HIGH-s1.safetensors", "m-LOW-s2.safetensors", "m-LOW-s3.safetensors"]
    assert find_pair("m-HIGH-s1.safetensors", listed).low is None


@pytest.mark.parametrize("metadata,expert", [
    ({"modelspec.timestep_range": "875,1000"}, "high"),  # musubi-tuner --min_timestep 875 --max_timestep 1000
    ({"modelspec.timestep_range": "0,875"}, "low"),
    ({"modelspec.timestep_range": "0,1000"}, None),  # a whole-range file: no expert
    ({"ss_sd_model_name": "wan2.2_i2v_high_noise_14B_fp16.safetensors"}, "high"),
    ({"ss_output_name": "mylora_low_noise"}, "low"),
    ({"modelspec.title": "Low Angle Shot"}, None),  # only the high_noise/low_noise spelling counts in metadata
    ({"ss_sd_model_name": "high_noise_and_low_noise"}, None),
    ({}, None),
])
def test_the_expert_a_file_s_metadata_names(metadata, expert):
    found = metadata_expert(metadata)
    assert (found and found.expert) == expert
    if found:
        assert found.evidence.split(" = ")[0] in metadata
