"""The multi-file loader's stored rows (nodes/loading/rows.py, issue #36): what a workflow's JSON means, and every
malformed row refused naming the row and the field."""

from __future__ import annotations

import json

import pytest
from lycoris_nodes.lycoris_core import LycorisError
from lycoris_nodes.nodes.loading.rows import Row, parse_rows, rows_text


def test_a_row_takes_its_defaults_from_what_it_leaves_out():
    (row,) = parse_rows('[{"lora": "style.safetensors"}]')
    assert row == Row("style.safetensors", on=True, strength=1.0, strength_clip=None, strength_low=None,
                      expert="auto", block_weights="")
    assert (row.clip_strength, row.low_strength) == (1.0, 1.0)


def test_rows_keep_their_order_and_values():
    text = json.dumps([
        {"on": False, "lora": "b.safetensors", "strength": 0.5, "strength_clip": 0.25},
        {"lora": "wan/a_HIGH.safetensors", "strength": 1, "strength_low": 0.75, "expert": "high",
         "block_weights": "default=1\nblocks.0=0.5"},
    ])
    first, second = parse_rows(text)
    assert (first.lora, first.on, first.strength, first.clip_strength) == ("b.safetensors", False, 0.5, 0.25)
    assert (second.lora, second.low_strength, second.expert) == ("wan/a_HIGH.safetensors", 0.75, "high")
    assert parse_rows(rows_text([first, second])) == [first, second]


@pytest.mark.parametrize("text", ["", "  ", "[]"])
def test_no_rows(text):
    assert parse_rows(text) == []


BAD = [
    ("[{", "the rows are not JSON"),
    ('{"lora": "a"}', "the rows must be a JSON list of rows, not dict"),
    ('["a.safetensors"]', "row 1 must be an object"),
    ('[{"lora": "a"}, {"strength": 1}]', "row 2 names no file ('lora')"),
    ('[{"lora": "a", "strenght": 1}]', "row 1 has 'strenght', which no row takes"),
    ('[{"lora": "a", "on": "yes"}]', "row 1 (a): 'on' must be true or false, not \"yes\""),
    ('[{"lora": "a", "strength": "1"}]', "row 1 (a): 'strength' must be a finite number, not \"1\""),
    ('[{"lora": "a", "strength": true}]', "row 1 (a): 'strength' must be a finite number, not true"),
    ('[{"lora": "a", "strength_clip": NaN}]', "row 1 (a): 'strength_clip' must be a finite number, not NaN"),
    ('[{"lora": "a", "strength_low": Infinity}]', "row 1 (a): 'strength_low' must be a finite number"),
    ('[{"lora": "a", "expert": "HIGH"}]', "row 1 (a): 'expert' must be one of auto, both, high, low"),
    ('[{"lora": "a", "block_weights": 3}]', "row 1 (a): 'block_weights' must be text"),
    ('[{"lora": "a", "block_weights": "input_blocks.1=x"}]', "row 1 (a): block weights:"),
]


@pytest.mark.parametrize(("text", "message"), BAD)
def test_a_malformed_row_is_refused_naming_row_and_field(text, message):
    with pytest.raises(LycorisError) as err:
        parse_rows(text)
    assert message in str(err.value)
