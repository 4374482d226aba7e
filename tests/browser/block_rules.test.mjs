// web/lycoris_block_rules.js under Node's test runner (no browser, no server): `node --test block_rules.test.mjs`.
//
// With CROSS_CHECK=<json file> it instead prints, for the [text, block] pairs in that file, the weight the JS gives
// each block as one JSON line: tests/e2e/test_browser_panel.py compares them with lycoris_core's parser.

import { readFileSync } from "node:fs";
import { test } from "node:test";
import assert from "node:assert/strict";

import { blockWeight, formatWeight, parseBlockWeights, setBlockRule } from "../../web/lycoris_block_rules.js";

const EXAMPLE = "default=1\ninput_blocks.1=0.5\nmiddle_block=1.5\noutput_blocks.0-1=0.75\nte=0.8";
const LBW17 = "1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1";

if (process.env.CROSS_CHECK) {
    const pairs = JSON.parse(readFileSync(process.env.CROSS_CHECK, "utf8"));
    console.log(JSON.stringify(pairs.map(([text, block]) => blockWeight(text, block))));
} else {
    test("a block's own rule gets the new value where it stands", () => {
        assert.equal(
            setBlockRule(EXAMPLE, "input_blocks.1", 0.75),
            "default=1\ninput_blocks.1=0.75\nmiddle_block=1.5\noutput_blocks.0-1=0.75\nte=0.8",
        );
        assert.equal(
            setBlockRule("default=1  # comment\ninput_blocks.1 = 0.5 # half", "input_blocks.1", 2),
            "default=1  # comment\ninput_blocks.1 = 2 # half",
        );
    });

    test("a block without a rule of its own gets one at the end, in the text's style", () => {
        assert.equal(setBlockRule(EXAMPLE, "middle_block.1", -0.8), `${EXAMPLE}\nmiddle_block.1=-0.8`);
        assert.equal(
            setBlockRule("default=1; input_blocks.4-8=0.5; output_blocks.*=0; te=0.8", "output_blocks.3", 0.3),
            "default=1; input_blocks.4-8=0.5; output_blocks.*=0; te=0.8; output_blocks.3=0.3",
        );
        assert.equal(setBlockRule("default=0.5\n", "x.1", 1.05), "default=0.5\nx.1=1.05\n");
        assert.equal(setBlockRule("", "x.1", 1), "x.1=1");
        assert.equal(setBlockRule(LBW17, "input_blocks.4", 0.2), `${LBW17}\ninput_blocks.4=0.2`);
    });

    test("a rule a later rule would override moves to the end", () => {
        assert.equal(setBlockRule("output_blocks.3=1; output_blocks.*=0", "output_blocks.3", 0.3), "output_blocks.*=0; output_blocks.3=0.3");
        assert.equal(setBlockRule("output_blocks.3=1\noutput_blocks.*=0\n", "output_blocks.3", 0.3), "output_blocks.*=0\noutput_blocks.3=0.3\n");
        assert.equal(setBlockRule(`input_blocks.4=0.1\n${LBW17}`, "input_blocks.4", 0.2), `${LBW17}\ninput_blocks.4=0.2`);
    });

    test("the weight a text gives a block", () => {
        assert.equal(blockWeight(EXAMPLE, "input_blocks.1"), 0.5);
        assert.equal(blockWeight(EXAMPLE, "middle_block.2"), 1.5);
        assert.equal(blockWeight(EXAMPLE, "output_blocks.1"), 0.75);
        assert.equal(blockWeight(EXAMPLE, "te.clip_l.layers.3"), 0.8);
        assert.equal(blockWeight(EXAMPLE, "time_embed"), 1);
        assert.equal(blockWeight("0,1,1,1,1,1,1,0.3,1,1,1,1,1,1,1,1,1", "middle_block.1"), 0.3);
        assert.equal(blockWeight("default=0.2; input_blocks.*=3 # all inputs", "input_blocks.7"), 3);
    });

    test("texts the server refuses are reported", () => {
        for (const text of ["a=", "a=x", "1,2", "=1"]) assert.ok(parseBlockWeights(text).error, text);
        assert.equal(parseBlockWeights("default=2").default, 2);
        assert.equal(parseBlockWeights(EXAMPLE).error, null);
    });

    test("weights are written with at most 2 decimals", () => {
        assert.equal(formatWeight(0.1 + 0.2), "0.3");
        assert.equal(formatWeight(-0.0001), "0");
        assert.equal(formatWeight(1), "1");
        assert.equal(formatWeight(-0.05), "-0.05");
    });
}
