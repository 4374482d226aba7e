// web/panel/view.js's coverage box under Node's test runner with a minimal DOM (no browser, no server):
// `node --test coverage_view.test.mjs`, run by tests/test_harmless_misses.py. Harmless misses (modules the model
// lacks by design) are listed apart in the neutral colour, and alone never make the box amber.

import { test } from "node:test";
import assert from "node:assert/strict";

class FakeNode {
    constructor(tag) {
        this.tagName = tag;
        this.children = [];
        this.className = "";
        this.textContent = "";
        this.title = "";
        this.style = {};
    }
    appendChild(child) {
        this.children.push(child);
        return child;
    }
    addEventListener() {}
}
globalThis.document = { createElement: (tag) => new FakeNode(tag) };
const { sections } = await import("../../web/panel/view.js");

const WAN = "Wan I2V image attention on a Wan model without it (T2V, Wan 2.2)";
const harmless = Array.from({ length: 7 }, (_, i) => [`diffusion_model.blocks.${i}.cross_attn.k_img.weight`, WAN]);

function box(report) {
    const [coverage] = sections({ report: { summary: null, blocks: undefined, warnings: [], ...report } });
    return coverage;
}

const lists = (node, className) => node.children.filter((c) => c.tagName === "ul" && c.className === className);

test("harmless misses alone: the box stays green, listed apart in the neutral colour", () => {
    const node = box({ line: `f: 33/40 modules applied, 7 not in this model (harmless: ${WAN})`, applied: 33,
        total: 40, problems: [], unused_keys: [], harmless });
    assert.equal(node.className, "lycoris-coverage lycoris-ok");
    assert.deepEqual(lists(node, "lycoris-problems"), []);
    const [list] = lists(node, "lycoris-problems lycoris-harmless");
    assert.deepEqual(list.children.map((li) => li.textContent), [
        ...harmless.slice(0, 5).map(([key, reason]) => `${key}: ${reason}`), "… and 2 more"]);
});

test("a failure beside harmless misses: amber, the failure listed as a problem", () => {
    const node = box({ line: "f: 33/41 modules applied", applied: 33, total: 41, unused_keys: [], harmless,
        problems: [["lora_unet_blocks_0_cross_attn_k_imgs.weight", "no weight of this model has this name"]] });
    assert.equal(node.className, "lycoris-coverage lycoris-warn");
    assert.equal(lists(node, "lycoris-problems")[0].children.length, 1);
    assert.equal(lists(node, "lycoris-problems lycoris-harmless").length, 1);
});

test("nothing applied, all misses harmless: still the error colour", () => {
    const node = box({ line: "f: 0/7 modules applied", applied: 0, total: 7, problems: [], unused_keys: [], harmless });
    assert.equal(node.className, "lycoris-coverage lycoris-error");
});

test("a report from before harmless misses existed (no field) reads as before", () => {
    const node = box({ line: "f: 3/4 modules applied", applied: 3, total: 4, unused_keys: [],
        problems: [["k.weight", "text-encoder module, but no CLIP is connected"]] });
    assert.equal(node.className, "lycoris-coverage lycoris-warn");
    assert.equal(lists(node, "lycoris-problems lycoris-harmless").length, 0);
});
