// The per-block sliders of LyCORIS Loader (Block Weights) in a real browser against a real ComfyUI server.
//
//   COMFY_URL=http://127.0.0.1:8188/ SCREENSHOT=/tmp/bw.png node tests/browser/block_weights.mjs
//
// Optional env: RENDERER=classic|vue (default classic), WORKFLOW (default example_workflows/lycoris_block_weights.json),
// CHROMIUM (default /usr/bin/chromium), TIMEOUT_MS for one workflow run (default 180000), EXAMPLES_DIR: after the
// checks, load every .json there and put the prompt the frontend makes of it (graphToPrompt) in the result, as
// `prompts` (then the example again, for the screenshots).
//
// Loads the example workflow, checks the sliders are not there before a run (a hint instead), queues it, checks a
// slider per block the file touches with the value the block_weights text gives it, then moves two sliders like a
// user: one with the keyboard (its rule exists: the value is replaced where it stands) and one by dragging it with
// the mouse to its left end (no rule of its own: one is added). Checks the block_weights widget value, the textarea
// the user sees, the serialized workflow (the panel is not in it), the workflow's change tracker (what undo and the
// "modified" mark go by), then queues again (the server accepts the new text and the chart follows it). Saves a
// screenshot and a close-up of the node ("<name>-node.png"), prints one JSON line; exit 0 = all checks passed,
// 1 = a check failed, 2 = bad usage.
// The server must not have the node's output cached (a fresh server, --cache-none, or POST /free {"free_memory": true}
// before the script).

import { readdirSync, readFileSync } from "node:fs";
import { join } from "node:path";

import {
    REPO, check, frames, graphLayout, loadWorkflow, mark, queueAndWait, runBrowserScript, setRenderer, settled, waitFor,
    within,
} from "./common.mjs";

const NODE_TYPE = "LycorisBlockWeights";
const TEXT_WIDGET = "block_weights";
// The example's block_weights and what its rules give each block of the demo file.
const EXPECT_VALUES = {
    "input_blocks.1": "0.5",
    "middle_block.0": "1.5",
    "middle_block.1": "1.5",
    "middle_block.2": "1.5",
    "output_blocks.0": "0.75",
    "output_blocks.1": "0.75",
};
const KEYBOARD_BLOCK = "input_blocks.1"; // has its own rule: replaced in place
const KEYBOARD_STEPS = 5; // ArrowRight x5 at step 0.05: 0.5 -> 0.75
const DRAG_BLOCK = "middle_block.1"; // only "middle_block=1.5" matches it: a rule is added
const CLOSE_UP = { scale: 1.1, top: 130 }; // canvas zoom and place for the node close-up screenshot

const WORKFLOW = process.env.WORKFLOW || join(REPO, "example_workflows", "lycoris_block_weights.json");
const EXAMPLES_DIR = process.env.EXAMPLES_DIR;

/** Other nodes whose box overlaps node `id`'s, in graph units (the saved layout, whichever renderer draws it). */
function nodesOver(id) {
    const graph = window.comfyAPI.app.app.graph;
    const title = window.LiteGraph.NODE_TITLE_HEIGHT;
    const box = (n) => {
        // The Vue renderer lays a node out by its content: its DOM size, in graph units, when it is taller.
        const el = document.querySelector(`.lg-node[data-node-id="${n.id}"]`);
        const scale = window.comfyAPI.app.app.canvas.ds.scale;
        const h = el && el.offsetParent !== null ? el.getBoundingClientRect().height / scale : n.size[1] + title;
        const w = el && el.offsetParent !== null ? el.getBoundingClientRect().width / scale : n.size[0];
        return [n.pos[0], n.pos[1] - title, n.pos[0] + w, n.pos[1] - title + Math.max(h, n.size[1] + title)];
    };
    const me = graph.getNodeById(id);
    const [x0, y0, x1, y1] = box(me);
    return graph.nodes.filter((n) => n !== me).filter((n) => {
        const [a0, b0, a1, b1] = box(n);
        return a0 < x1 - 1 && a1 > x0 + 1 && b0 < y1 - 1 && b1 > y0 + 1;
    }).map((n) => ({ type: n.type, title: n.title, pos: n.pos, overlaps: [x0, y0, x1, y1].map(Math.round) }));
}

/** The Block Weights node's widget, textarea, panel and sliders, read in the page. */
function editorState(nodeType) {
    const app = window.comfyAPI.app.app;
    const node = app.graph.nodes.find((n) => n.type === nodeType);
    if (!node) return { ok: false, reason: `no ${nodeType} node` };
    const widget = node.widgets?.find((w) => w.name === "block_weights");
    const panel = node.widgets?.find((w) => w.name === "lycoris_panel")?.element;
    if (!widget || !panel) return { ok: false, reason: "no block_weights widget or panel" };
    // The textarea the user sees: the widget's own element (classic), or the one in the Vue node.
    const vueNode = document.querySelector(`.lg-node[data-node-id="${node.id}"]`);
    const areas = [...new Set([widget.inputEl, widget.element, ...(vueNode ? vueNode.querySelectorAll("textarea") : [])])]
        .filter((a) => a && a.tagName === "TEXTAREA");
    const lineHeight = (a) => {
        const style = getComputedStyle(a);
        return parseFloat(style.lineHeight) || 1.2 * parseFloat(style.fontSize); // "normal" is about 1.2em
    };
    const rows = [...panel.querySelectorAll(".lycoris-slider-row")].map((row) => ({
        block: row.dataset.block,
        range: row.querySelector("input[type=range]")?.value,
        number: row.querySelector("input[type=number]")?.value,
    }));
    const chart = Object.fromEntries(
        [...panel.querySelectorAll(".lycoris-chart .lycoris-row")].map((r) => [
            r.querySelector(".lycoris-block-name")?.textContent,
            r.querySelector(".lycoris-value")?.textContent,
        ]),
    );
    const workflow = app.extensionManager?.workflow?.activeWorkflow;
    return {
        ok: true,
        nodeId: node.id,
        value: widget.value,
        textareas: areas.map((a) => a.value),
        // The textarea the user sees (in the Vue node, or the classic one): rows it shows, lines in it.
        shown: areas.filter((a) => a.offsetParent !== null).map((a) => ({
            rows: Math.floor((a.clientHeight - parseFloat(getComputedStyle(a).paddingTop)
                - parseFloat(getComputedStyle(a).paddingBottom)) / lineHeight(a)),
            lines: a.value.split("\n").length,
            overflow: a.scrollHeight - a.clientHeight,
        })),
        rows,
        chart,
        notes: [...panel.querySelectorAll(".lycoris-blocks .lycoris-note")].map((e) => e.textContent),
        errors: [...panel.querySelectorAll(".lycoris-error")].map((e) => e.textContent),
        // 1.49.6 gives live nodes string ids ("2") and serializes them as numbers (2); 1.32.9 numbers in both.
        saved: app.graph.serialize().nodes.find((n) => String(n.id) === String(node.id))?.widgets_values,
        // The text in the change tracker's copy of the graph, which undo and the "modified" mark go by.
        tracked: workflow?.changeTracker?.activeState?.nodes.find((n) => String(n.id) === String(node.id))
            ?.widgets_values?.[3],
    };
}

function sliderLocator(page, nodeId, block) {
    return page.locator(`.lycoris-panel[data-node-id="${nodeId}"] .lycoris-slider-row[data-block="${block}"] input[type=range]`);
}

async function checks({ page, result, workflow, original, pageErrors, consoleErrors }) {
    const originalText = original[3];
    await setRenderer(page);
    // No earlier run's report may be restored into the panel (it restores the last run with the same inputs from the
    // server's history, and the other browser scripts ran the examples on this server): "before any run" is meant.
    await page.evaluate(() => window.comfyAPI.api.api.fetchApi("/history", {
        method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify({ clear: true }),
    }));
    await loadWorkflow(page, workflow);

    const before = await waitFor(page, "the Block Weights panel and its textarea on screen", (t) => {
        const s = window.__lycorisEditorState(t);
        return s.ok && s.shown.length ? s : { ...s, ok: false };
    }, NODE_TYPE);
    check(before.value === originalText, `block_weights is ${JSON.stringify(before.value)} after loading`);
    check(before.rows.length === 0, `sliders before any run: ${JSON.stringify(before.rows)}`);
    check(before.notes.some((n) => n.includes("run the workflow")), `no hint before the run: ${before.notes}`);
    // The example's rules are all in view: the Vue renderer's textarea showed about three lines.
    check(before.shown.length === 1, `expected one visible block_weights textarea: ${JSON.stringify(before.shown)}`);
    const [shown] = before.shown;
    check(shown.rows >= 7 && shown.overflow <= 1, `the block_weights box shows ${shown.rows} rows (needs 7+ and the `
        + `example's ${shown.lines} lines without scrolling): ${JSON.stringify(shown)}`);

    await queueAndWait(page);
    mark("first_run");
    const ran = await waitFor(
        page,
        "a slider per block after the run",
        ([t, n]) => {
            const s = window.__lycorisEditorState(t);
            return s.ok && s.rows.length >= n && Object.keys(s.chart).length ? s : { ...s, ok: false };
        },
        [NODE_TYPE, Object.keys(EXPECT_VALUES).length],
        15000,
    );
    const values = Object.fromEntries(ran.rows.map((r) => [r.block, r.number]));
    check(
        JSON.stringify(values) === JSON.stringify(EXPECT_VALUES),
        `sliders ${JSON.stringify(values)}, expected ${JSON.stringify(EXPECT_VALUES)}`,
    );
    for (const row of ran.rows) check(Number(row.range) === Number(row.number), `slider/number differ: ${JSON.stringify(row)}`);
    check(ran.errors.length === 0, `the panel shows an error: ${ran.errors}`);
    check(ran.tracked === originalText, `the change tracker holds ${JSON.stringify(ran.tracked)} after the run`);
    result.chart_before = ran.chart;
    await settled(page, "the nodes' layout after the run (the panel's chart and sliders grow the node)", graphLayout);
    const covering = await page.evaluate(nodesOver, ran.nodeId);
    check(covering.length === 0, `after the run the node (grown by its panel) is overlapped by ${JSON.stringify(covering)}: `
        + "the example's layout must leave it room");

    // 1. The keyboard on the input_blocks.1 slider: its rule gets the new value where it stands.
    const keyed = sliderLocator(page, ran.nodeId, KEYBOARD_BLOCK);
    await keyed.focus();
    for (let i = 0; i < KEYBOARD_STEPS; i++) await keyed.press("ArrowRight");
    const keyedValue = formatWeight(Number(EXPECT_VALUES[KEYBOARD_BLOCK]) + KEYBOARD_STEPS * 0.05);
    const afterKeys = originalText.replace(`${KEYBOARD_BLOCK}=${EXPECT_VALUES[KEYBOARD_BLOCK]}`, `${KEYBOARD_BLOCK}=${keyedValue}`);
    check(afterKeys !== originalText, "the expected text did not change (test setup)");
    const keyedState = await waitFor(
        page,
        `block_weights with ${KEYBOARD_BLOCK}=${keyedValue}`,
        ([t, want]) => {
            const s = window.__lycorisEditorState(t);
            return s.value === want ? s : { ...s, ok: false };
        },
        [NODE_TYPE, afterKeys],
        5000,
    );
    result.after_keyboard = keyedState.value;

    // 2. Drag the middle_block.1 slider with the mouse to its left end (-1): a rule of its own is added.
    const dragged = sliderLocator(page, ran.nodeId, DRAG_BLOCK);
    await dragged.scrollIntoViewIfNeeded();
    let box = await dragged.boundingBox();
    const viewport = page.viewportSize();
    if (box && box.y + box.height > viewport.height - 40) {
        // Below the page (the canvas does not scroll into view): pan the canvas up, as a user drags it.
        await page.evaluate((dy) => {
            const canvas = window.comfyAPI.app.app.canvas;
            canvas.ds.offset[1] -= dy / canvas.ds.scale;
            canvas.setDirty(true, true);
        }, box.y + box.height - viewport.height / 2);
        // Until the slider stays where it is (the Vue nodes follow the canvas a frame or more later).
        await settled(page, "the nodes' layout after panning the canvas", graphLayout);
        const deadline = Date.now() + within(10000);
        for (let still = 0; still < 3 && Date.now() < deadline;) {
            await frames(page, 1);
            const now = await dragged.boundingBox();
            still = JSON.stringify(now) === JSON.stringify(box) ? still + 1 : 0;
            box = now;
        }
    }
    check(box && box.width > 20, `the ${DRAG_BLOCK} slider is not visible: ${JSON.stringify(box)}`);
    const fraction = (Number(EXPECT_VALUES[DRAG_BLOCK]) + 1) / 3; // where its thumb is on -1..2
    const y = box.y + box.height / 2;
    await page.mouse.move(box.x + fraction * box.width, y);
    await page.mouse.down();
    await page.mouse.move(box.x + box.width * 0.4, y, { steps: 5 });
    await page.mouse.move(box.x - 40, y, { steps: 5 });
    await page.mouse.up();
    const expected = `${afterKeys}\n${DRAG_BLOCK}=-1`;
    const edited = await waitFor(
        page,
        `block_weights with ${DRAG_BLOCK}=-1 added`,
        ([t, want]) => {
            const s = window.__lycorisEditorState(t);
            return s.value === want ? s : { ...s, ok: false };
        },
        [NODE_TYPE, expected],
        5000,
    );
    mark("sliders_moved");
    check(edited.textareas.length > 0, "no block_weights textarea found in the page");
    check(edited.textareas.every((v) => v === expected), `the textarea shows ${JSON.stringify(edited.textareas)}`);
    check(
        Array.isArray(edited.saved) && edited.saved.length === original.length && edited.saved[3] === expected,
        `serialized widgets_values ${JSON.stringify(edited.saved)} (expected ${original.length} values, the new text 4th)`,
    );
    check(
        JSON.stringify(edited.saved.filter((_, i) => i !== 3)) === JSON.stringify(original.filter((_, i) => i !== 3)),
        `other widget values changed: ${JSON.stringify(edited.saved)}`,
    );
    const moved = Object.fromEntries(edited.rows.map((r) => [r.block, r.number]));
    check(moved[KEYBOARD_BLOCK] === keyedValue && moved[DRAG_BLOCK] === "-1", `numbers now ${JSON.stringify(moved)}`);
    // Not the workflow's "modified" mark: the run has set it already, in both frontends (the panel grows the node to
    // fit the report), so it says nothing about the sliders. The change tracker must hold the new text.
    check(edited.tracked === expected, `the change tracker holds ${JSON.stringify(edited.tracked)}`);
    result.after_drag = edited.value;

    // 3. The server accepts the new text, and the chart follows it.
    await queueAndWait(page);
    mark("second_run");
    const rerun = await waitFor(
        page,
        `the chart to change for ${DRAG_BLOCK}`,
        ([t, block, old]) => {
            const s = window.__lycorisEditorState(t);
            return s.ok && s.chart[block] && s.chart[block] !== old ? s : { ...s, ok: false };
        },
        [NODE_TYPE, DRAG_BLOCK, ran.chart[DRAG_BLOCK]],
        15000,
    );
    result.chart_after = rerun.chart;
    check(rerun.value === expected, `block_weights changed by the run: ${JSON.stringify(rerun.value)}`);
    check(rerun.rows.find((r) => r.block === DRAG_BLOCK)?.number === "-1", "the slider moved back after the run");

    const ours = [...pageErrors, ...consoleErrors].filter((e) => /lycoris/i.test(e));
    check(ours.length === 0, `errors from the extension: ${ours.join("\n")}`);
    if (EXAMPLES_DIR) {
        // Last: loading an example restores the reports of its earlier runs into its panels.
        result.prompts = {};
        for (const file of readdirSync(EXAMPLES_DIR).filter((f) => f.endsWith(".json")).sort()) {
            const graph = JSON.parse(readFileSync(join(EXAMPLES_DIR, file), "utf8"));
            result.prompts[file] = await page.evaluate(async (wf) => {
                const app = window.comfyAPI.app.app;
                await app.loadGraphData(wf);
                const missing = wf.nodes.filter((n) => !(n.type in window.LiteGraph.registered_node_types));
                return { missing: missing.map((n) => n.type), output: (await app.graphToPrompt()).output };
            }, graph);
        }
        mark("examples_converted");
        await loadWorkflow(page, workflow);
    }
    result.ok = true;
}

function formatWeight(value) {
    return String(Math.round(value * 100) / 100);
}

runBrowserScript({
    name: "block_weights.mjs",
    workflowPath: WORKFLOW,
    nodeType: NODE_TYPE,
    closeUp: CLOSE_UP,
    initScript: `window.__lycorisEditorState = ${editorState};`,
    stateKey: "state",
    readState: (page) => page.evaluate((t) => window.__lycorisEditorState?.(t), NODE_TYPE),
    body: checks,
});
