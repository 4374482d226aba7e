// web/panel/rows_model.js (what the rows editor reads and writes) under Node's test runner: `node --test
// rows_editor.test.mjs` (no browser, no server).
//
// With CROSS_CHECK=<json file> it instead prints, for the texts in that file, what rowsText(parseRows(text)) writes
// (null where parseRows refuses the text) as one JSON line: tests/e2e/test_browser_rows.py compares them with
// rows.py's rows_text(parse_rows(text)).

import { readFileSync } from "node:fs";
import { test } from "node:test";
import assert from "node:assert/strict";

import {
    addRow, moveRow, parseRows, pyFloat, removeRow, reportByRow, rowsText, setField, toggleAll,
} from "../../web/panel/rows_model.js";

const TWO = '[{"on": true, "lora": "wan/motion_HIGH.safetensors", "strength": 0.8}, '
    + '{"on": false, "lora": "style.safetensors", "strength": 1.0, "strength_clip": 0.5, '
    + '"block_weights": "default=1; output_blocks.*=0"}]';

if (process.env.CROSS_CHECK) {
    const texts = JSON.parse(readFileSync(process.env.CROSS_CHECK, "utf8"));
    console.log(JSON.stringify(texts.map((text) => {
        const { rows } = parseRows(text);
        return rows && rowsText(rows);
    })));
} else {
    test("a text as rows.py writes it reads back to the same text", () => {
        const { rows, error } = parseRows(TWO);
        assert.equal(error, null);
        assert.equal(rowsText(rows), TWO);
        assert.deepEqual(rows[1], {
            on: false, lora: "style.safetensors", strength: 1, strength_clip: 0.5,
            block_weights: "default=1; output_blocks.*=0",
        });
    });

    test("defaults are filled in and written as rows.py writes them", () => {
        const { rows } = parseRows('[{"lora": "a.safetensors"}, {"lora": "b", "strength": 2, "expert": "auto", "block_weights": ""}]');
        assert.equal(rowsText(rows), '[{"on": true, "lora": "a.safetensors", "strength": 1.0}, '
            + '{"on": true, "lora": "b", "strength": 2.0}]');
        assert.equal(rowsText([]), "[]");
    });

    test("numbers as Python's repr writes floats", () => {
        const cases = [[1, "1.0"], [0.8, "0.8"], [-0.25, "-0.25"], [0, "0.0"], [-0, "-0.0"], [1e-5, "1e-05"],
            [0.0001, "0.0001"], [1.5e-7, "1.5e-07"], [1e16, "1e+16"], [123456789012345.6, "123456789012345.6"],
            [1.2345678901234568e22, "1.2345678901234568e+22"], [0.1 + 0.2, "0.30000000000000004"]];
        for (const [x, want] of cases) assert.equal(pyFloat(x), want, String(x));
    });

    test("experts fields and names with quotes and non-ASCII letters", () => {
        const text = '[{"on": true, "lora": "wan/\\"q\\" é.safetensors", "strength": 0.5, "strength_low": 0.25, "expert": "high"}]';
        assert.equal(rowsText(parseRows(text).rows), text);
    });

    test("what the server refuses is an error, and no rows to rewrite", () => {
        const bad = {
            "[{": "not JSON",
            '{"lora": "a"}': "JSON list",
            '["a"]': "row 1 must be an object",
            '[{"lora": "a", "strenght": 1}]': "'strenght'",
            '[{"lora": "a", "on": 1}]': "'on'",
            '[{"lora": "a", "expert": "mid"}]': "'expert'",
            '[{"lora": "a", "strength": "1"}]': "'strength'",
            '[{"lora": "a"}, {"lora": "b", "strength_clip": "x"}]': "row 2: 'strength_clip'",
            '[{"lora": 3}]': "'lora'",
        };
        for (const [text, says] of Object.entries(bad)) {
            const { rows, error } = parseRows(text);
            assert.equal(rows, null, text);
            assert.ok(error.includes(says), `${text}: ${error}`);
        }
        assert.deepEqual(parseRows("  "), { rows: [], error: null });
    });

    test("edits: add, move, remove, toggle all, set and unset a field", () => {
        const { rows } = parseRows(TWO);
        const added = addRow(rows, "c.safetensors");
        assert.equal(added.length, 3);
        assert.deepEqual(added[2], { on: true, lora: "c.safetensors", strength: 1 });
        assert.equal(rows.length, 2, "the argument is left as it was");
        assert.deepEqual(moveRow(added, 2, -1).map((r) => r.lora), ["wan/motion_HIGH.safetensors", "c.safetensors", "style.safetensors"]);
        assert.equal(moveRow(added, 0, -1), added, "the first row cannot move up");
        assert.equal(moveRow(added, 2, 1), added, "the last row cannot move down");
        assert.deepEqual(removeRow(added, 0).map((r) => r.lora), ["style.safetensors", "c.safetensors"]);
        assert.deepEqual(toggleAll(added).map((r) => r.on), [true, true, true], "some off: all on");
        assert.deepEqual(toggleAll(toggleAll(added)).map((r) => r.on), [false, false, false], "all on: all off");
        const unset = setField(rows, 1, "strength_clip", null);
        assert.equal(rowsText(unset), TWO.replace(', "strength_clip": 0.5', ""));
        assert.equal(rowsText(setField(rows, 0, "expert", "low")), TWO.replace('0.8}', '0.8, "expert": "low"}'));
        assert.equal(rowsText(setField(setField(rows, 0, "expert", "low"), 0, "expert", "auto")), TWO);
        assert.equal(rowsText(setField(rows, 1, "block_weights", "")), TWO.replace(', "block_weights": "default=1; output_blocks.*=0"', ""));
        assert.throws(() => setField(rows, 0, "weight", 1));
    });

    test("the report goes under the rows that name its files, also after a move", () => {
        const { rows } = parseRows(TWO);
        const entries = [
            { source: "row", row: 1, lora: "wan/motion_HIGH.safetensors" },
            { source: "row", row: 2, lora: "style.safetensors" },
            { source: "text", row: null, lora: "tagged" },
            { source: "row", row: 3, lora: "removed.safetensors" },
        ];
        const { byRow, others } = reportByRow(entries, rows);
        assert.deepEqual(byRow.map((e) => e.map((x) => x.row)), [[1], [2]]);
        assert.deepEqual(others.map((e) => e.lora), ["tagged", "removed.safetensors"]);
        const moved = reportByRow(entries, moveRow(rows, 1, -1));
        assert.deepEqual(moved.byRow.map((e) => e.map((x) => x.row)), [[2], [1]]);
        assert.deepEqual(reportByRow(null, rows).byRow, [[], []]);
    });
}
