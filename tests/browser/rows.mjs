// The rows editor of LyCORIS Loader (Rows) (web/panel/rows_editor.js) in a real browser against a real ComfyUI server
// (tests/e2e/test_browser_rows.py).
//
//   COMFY_URL=http://127.0.0.1:8188/ SCREENSHOT=/tmp/rows.png RENDERER=vue WORKFLOW=/tmp/rows.json \
//   EXPERTS_WORKFLOW=/tmp/experts.json node tests/browser/rows.mjs
//
// WORKFLOW: a workflow with one LycorisRows node whose `rows` (its first widget value) are INITIAL below, its model
// and clip linked, and its lora_text fed one <lora:...> tag. EXPERTS_WORKFLOW (optional; the e2e test always gives
// it): one LycorisExperts node on the tiny Wan experts (scripts/make_tiny_wan.py), clip not linked, whose `rows` are
// EXPERTS_INITIAL below.
//
// Edits the rows like a user, through the editor (clicks and typing), and after each step checks the `rows` widget's
// text character for character (what rows.py's rows_text writes) and the rows the editor draws: add a row, type its
// file and strength, switch one off, move one up, remove one, switch all off and on, break the text by hand (the
// error shows, the text is kept, no row is drawn) and put it right. Then: the `rows` textarea is nowhere on screen,
// the saved workflow holds the text and nothing of the editor, the change tracker has it (undo). Queues the workflow:
// each row shows its report, the lora_text tag's report shows below the rows, no node covers another. Reloads the
// page: the same rows and the same report are drawn. Then, in the same page, the experts workflow: its row shows the
// low-noise strength and the expert (no clip strength: clip is not linked); the low strength typed and the expert
// set to "both" and back to "auto" write the text rows.py writes; queued, the row shows one line per expert (the
// HIGH file on the high-noise expert, its LOW sibling on the low-noise one, each with its modules applied), the
// pairing note and both files' trigger words, and no node covers another. The pack must cause no console warning or
// error over the whole run (common.mjs).
// The server must not have the node's output cached (test_browser_rows.py's panel_server forgets it).

import { readFileSync } from "node:fs";
import { join } from "node:path";

import {
    REPO, SCREENSHOT, check, frames, loadWorkflow, mark, nodeBox, nodeRects, queueAndWait, reopenUI, runBrowserScript,
    setRenderer, settled, waitFor,
} from "./common.mjs";

const NODE_TYPE = "LycorisRows";
const A = "demo_lokr_dora.safetensors";
const B = "demo_loha_te.safetensors";
const WORKFLOW = process.env.WORKFLOW || join(REPO, "example_workflows", "lycoris_rows.json");

/** A row's JSON as rows.py writes it (strength as Python writes a float). */
const row = (on, lora, strength, extra = "") => `{"on": ${on}, "lora": "${lora}", "strength": ${strength}${extra}}`;
const list = (...rows) => `[${rows.join(", ")}]`;
const CLIP_HALF = ', "strength_clip": 0.5';
const INITIAL = list(row(true, A, "1.0"), row(true, B, "0.75", CLIP_HALF));
const EXPERTS_TYPE = "LycorisExperts";
const EXPERTS_WORKFLOW = process.env.EXPERTS_WORKFLOW;
const WAN_HIGH = "tiny_wan22_motion_HIGH.safetensors";
const WAN_LOW = "tiny_wan22_motion_LOW.safetensors";
const EXPERTS_INITIAL = list(row(true, WAN_HIGH, "0.8"));
const WAN_TRIGGERS = "trigger words: tiny wan high, tiny wan low";

/** The `type` node's `rows` text, the rows its editor draws, their report, and where the textareas are. */
function rowsState(type) {
    const app = window.comfyAPI.app.app;
    const node = app.graph.nodes.find((n) => n.type === type);
    if (!node) return { ok: false, reason: `no ${type} node` };
    const widget = node.widgets?.find((w) => w.name === "rows");
    const root = node.widgets?.find((w) => w.name === "lycoris_rows")?.element;
    if (!widget || !root) return { ok: false, reason: "no rows widget or rows editor" };
    const texts = (box, sel) => [...box.querySelectorAll(sel)].map((e) => e.textContent);
    const shown = (e) => !!e && e.offsetParent !== null && e.getBoundingClientRect().height > 0;
    // A field: its value, or null when the row has none on screen (absent or hidden).
    const field = (r, sel) => {
        const e = r.querySelector(sel);
        return shown(e) ? e.value : null;
    };
    const rows = [...root.querySelectorAll(".lycoris-rows-row")].map((r) => ({
        on: r.querySelector(".lycoris-rows-on")?.checked,
        lora: r.querySelector(".lycoris-rows-file")?.value,
        strength: r.querySelector(".lycoris-rows-strength")?.value,
        clip: field(r, ".lycoris-rows-strength-clip"),
        low: field(r, ".lycoris-rows-strength-low"),
        expert: field(r, ".lycoris-rows-expert"),
        lines: texts(r, ".lycoris-rows-report .lycoris-rows-line"),
        notes: texts(r, ".lycoris-rows-report .lycoris-rows-note"),
        triggers: texts(r, ".lycoris-rows-report .lycoris-rows-triggers"),
    }));
    // The `rows` textarea on screen: the widget's own (classic) or one in the Vue node other than the editor's.
    const vueNode = document.querySelector(`.lg-node[data-node-id="${node.id}"]`);
    const areas = [...new Set([widget.element, ...(vueNode ? vueNode.querySelectorAll("textarea") : [])])]
        .filter((a) => a?.tagName === "TEXTAREA" && !a.classList.contains("lycoris-rows-textarea"));
    const saved = app.graph.serialize().nodes.find((n) => String(n.id) === String(node.id));
    const workflow = app.extensionManager?.workflow?.activeWorkflow;
    return {
        ok: true,
        nodeId: node.id,
        value: widget.value,
        rows,
        editorShown: shown(root),
        rowsTextareasShown: areas.filter(shown).length,
        errors: texts(root, ".lycoris-rows-error"),
        others: texts(root, ".lycoris-rows-other .lycoris-rows-other-name"),
        othersLines: texts(root, ".lycoris-rows-other .lycoris-rows-line"),
        saved: saved?.widgets_values,
        savedKeys: Object.keys(saved ?? {}).sort(),
        // The text in the change tracker's copy of the graph, which undo and the "modified" mark go by.
        tracked: workflow?.changeTracker?.activeState?.nodes.find((n) => String(n.id) === String(node.id))?.widgets_values?.[0],
    };
}

/** [on, lora, strength] of each row a `rows` text holds, as the editor should draw them. */
function drawnFrom(text) {
    return JSON.parse(text).map((r) => [r.on, r.lora, String(r.strength)]);
}

/**
 * Wait until the `type` node's `rows` text is `expected`, then check the editor draws its rows; `step` names the
 * edit.
 */
async function expectRows(page, step, expected, type = NODE_TYPE) {
    const s = await waitFor(page, `the rows text after "${step}" to be ${expected}`, ([t, want]) => {
        const state = window.__rowsState(t);
        return state.ok && state.value === want ? state : { ...state, ok: false };
    }, [type, expected], 5000);
    const drawn = s.rows.map((r) => [r.on, r.lora, r.strength]);
    check(JSON.stringify(drawn) === JSON.stringify(drawnFrom(expected)),
        `after "${step}" the editor draws ${JSON.stringify(drawn)}, expected ${JSON.stringify(drawnFrom(expected))}`);
    check(s.errors.length === 0, `after "${step}" the editor shows an error: ${s.errors}`);
    return s;
}

/**
 * A close-up of the first `type` node as the page shows it now, to `path` (common.mjs takes its own close-up only
 * of the node of the first workflow, which the experts workflow replaces).
 */
async function nodeScreenshot(page, type, path) {
    await page.mouse.move(1590, 990); // no hover tooltips in the picture
    await frames(page, 2);
    const box = await page.evaluate(nodeBox, type);
    if (!box) return null;
    const pad = 12;
    const x = Math.max(0, box.x - pad);
    const y = Math.max(0, box.y - pad);
    const size = page.viewportSize();
    const width = Math.min(size.width - x, box.width + 2 * pad);
    const height = Math.min(size.height - y, box.height + 2 * pad);
    if (width <= 0 || height <= 0) return null;
    await page.screenshot({ path, clip: { x, y, width, height } });
    return path;
}

/** The row's report line of the `arrow` expert ("→ high-noise"), or a failed check naming what was drawn. */
function expertLine(lines, arrow) {
    const found = lines.filter((l) => l.startsWith(arrow));
    check(found.length === 1, `${found.length} report lines for ${arrow}, expected 1: ${JSON.stringify(lines)}`);
    return found[0];
}

/** The experts node (EXPERTS_WORKFLOW) in the same page: its row's fields, two edits, the run's two placements. */
async function expertsChecks(page, result) {
    const start = Date.now();
    const workflow = JSON.parse(readFileSync(EXPERTS_WORKFLOW, "utf8"));
    const given = workflow.nodes.find((n) => n.type === EXPERTS_TYPE)?.widgets_values?.[0];
    check(given === EXPERTS_INITIAL, `the experts workflow's rows are ${JSON.stringify(given)}, not EXPERTS_INITIAL`);
    await loadWorkflow(page, workflow);
    const loaded = await waitFor(page, "the experts editor on screen with the workflow's row", (t) => {
        const s = window.__rowsState(t);
        return s.ok && s.editorShown && s.rows.length ? s : { ...s, ok: false };
    }, EXPERTS_TYPE, 30000);
    await expectRows(page, "loading the experts workflow", EXPERTS_INITIAL, EXPERTS_TYPE);
    const [first] = loaded.rows;
    check(first.low === "" && first.expert === "auto",
        `the experts row's low strength and expert: ${JSON.stringify(first)} (expected "" and "auto", on screen)`);
    check(first.clip === null, `the experts row shows a clip strength with clip not linked: ${JSON.stringify(first)}`);
    check(first.lines.length === 0, `a report before the run: ${JSON.stringify(first.lines)}`);
    check(loaded.rowsTextareasShown === 0, `the experts node's rows textarea is on screen (${loaded.rowsTextareasShown})`);

    const editor = page.locator(`.lycoris-rows[data-node-id="${loaded.nodeId}"]`);
    const inRow = (sel) => editor.locator(`.lycoris-rows-row[data-row="1"] ${sel}`);
    const steps = [];
    const step = async (name, expected, drawn, act) => {
        await act();
        const s = await expectRows(page, name, expected, EXPERTS_TYPE);
        const [r] = s.rows;
        check(r.low === drawn.low && r.expert === drawn.expert,
            `after "${name}" the row draws low ${JSON.stringify(r.low)} and expert ${JSON.stringify(r.expert)}, `
            + `expected ${JSON.stringify(drawn)}`);
        steps.push({ step: name, value: s.value });
        return s;
    };
    const low = list(row(true, WAN_HIGH, "0.8", ', "strength_low": 0.5'));
    await step("low strength 0.5", low, { low: "0.5", expert: "auto" }, async () => {
        await inRow(".lycoris-rows-strength-low").fill("0.5");
        await inRow(".lycoris-rows-strength-low").press("Enter");
    });
    await step("expert both", list(row(true, WAN_HIGH, "0.8", ', "strength_low": 0.5, "expert": "both"')),
        { low: "0.5", expert: "both" }, () => inRow(".lycoris-rows-expert").selectOption("both"));
    await step("expert auto again", low, { low: "0.5", expert: "auto" },
        () => inRow(".lycoris-rows-expert").selectOption("auto"));
    mark("experts_edited");

    await queueAndWait(page, EXPERTS_TYPE);
    const ran = await waitFor(page, "the experts row's report after the run", (t) => {
        const state = window.__rowsState(t);
        const r = state.ok && state.rows.length === 1 ? state.rows[0] : null;
        return r && r.lines.length && r.triggers.length ? state : { ...state, ok: false };
    }, EXPERTS_TYPE, 15000);
    mark("experts_ran");
    const [done] = ran.rows;
    result.experts = { steps, report: { lines: done.lines, notes: done.notes, triggers: done.triggers } };
    check(done.lines.length === 2, `the row's report has ${done.lines.length} lines, expected one per expert: `
        + JSON.stringify(done.lines));
    // Each expert's line names its file (the coverage line does), at its strength (fmtNum: 0.80), all applied.
    const high = expertLine(done.lines, "→ high-noise");
    const lowLine = expertLine(done.lines, "→ low-noise");
    const placed = (line, file, other, strength) => line.includes(file) && !line.includes(other)
        && new RegExp(`@ ${strength}0?(?!\\d)`).test(line) && / modules applied/.test(line);
    check(placed(high, WAN_HIGH, WAN_LOW, "0\\.8"), `the high-noise expert's line: ${JSON.stringify(high)}`);
    check(placed(lowLine, WAN_LOW, WAN_HIGH, "0\\.5"), `the low-noise expert's line: ${JSON.stringify(lowLine)}`);
    check(done.notes.some((n) => n.includes("pair by name (HIGH / LOW)") && n.includes(WAN_HIGH) && n.includes(WAN_LOW)),
        `the pairing note: ${JSON.stringify(done.notes)}`);
    check(JSON.stringify(done.triggers) === JSON.stringify([WAN_TRIGGERS]), `trigger words: ${JSON.stringify(done.triggers)}`);
    check(ran.value === low, `the run changed the experts rows text: ${JSON.stringify(ran.value)}`);
    const layout = await settled(page, "the nodes' rectangles after the experts run", nodeRects, null, { quietMs: 600 });
    check(layout.overlaps.length === 0, `nodes cover each other after the experts run: ${JSON.stringify(layout)}`);
    result.experts_screenshot = await nodeScreenshot(page, EXPERTS_TYPE, SCREENSHOT.replace(/(\.png)?$/i, "-experts.png"));
    result.experts.seconds = (Date.now() - start) / 1000;
}

async function checks({ page, result, workflow, original }) {
    check(original[0] === INITIAL, `the workflow's rows are ${JSON.stringify(original[0])}, not the script's INITIAL`);
    await setRenderer(page);
    // No earlier run's report may be restored into the editor: "before the run" is meant.
    await page.evaluate(() => window.comfyAPI.api.api.fetchApi("/history", {
        method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify({ clear: true }),
    }));
    await loadWorkflow(page, workflow);
    const loaded = await waitFor(page, "the rows editor on screen with the workflow's rows", (t) => {
        const s = window.__rowsState(t);
        return s.ok && s.editorShown && s.rows.length ? s : { ...s, ok: false };
    }, NODE_TYPE, 30000);
    const nodeId = loaded.nodeId;
    await expectRows(page, "loading the workflow", INITIAL);
    check(loaded.rowsTextareasShown === 0, `the rows textarea is on screen (${loaded.rowsTextareasShown})`);
    check(loaded.rows[1].clip === "0.5" && loaded.rows[0].clip === "", `clip strengths drawn: ${JSON.stringify(loaded.rows)}`);
    const editor = page.locator(`.lycoris-rows[data-node-id="${nodeId}"]`);
    const inRow = (n, sel) => editor.locator(`.lycoris-rows-row[data-row="${n}"] ${sel}`);
    const steps = [];
    const step = async (name, expected, act) => {
        await act();
        const s = await expectRows(page, name, expected);
        steps.push({ step: name, value: s.value });
        return s;
    };

    let want = list(row(true, A, "1.0"), row(true, B, "0.75", CLIP_HALF), row(true, "", "1.0"));
    await step("+ row", want, () => editor.locator(".lycoris-rows-add").click());
    want = list(row(true, A, "1.0"), row(true, B, "0.75", CLIP_HALF), row(true, A, "1.0"));
    await step("type the new row's file", want, async () => {
        await inRow(3, ".lycoris-rows-file").click();
        await page.keyboard.type(A);
        await page.keyboard.press("Enter");
    });
    want = list(row(true, A, "1.0"), row(true, B, "0.75", CLIP_HALF), row(true, A, "0.3"));
    await step("type the new row's strength", want, async () => {
        await inRow(3, ".lycoris-rows-strength").fill("0.3");
        await inRow(3, ".lycoris-rows-strength").press("Enter");
    });
    want = list(row(true, A, "1.0"), row(false, B, "0.75", CLIP_HALF), row(true, A, "0.3"));
    await step("switch row 2 off", want, () => inRow(2, ".lycoris-rows-on").click());
    want = list(row(true, A, "1.0"), row(true, A, "0.3"), row(false, B, "0.75", CLIP_HALF));
    await step("move row 3 up", want, () => inRow(3, ".lycoris-rows-up").click());
    want = list(row(true, A, "0.3"), row(false, B, "0.75", CLIP_HALF));
    await step("remove row 1", want, () => inRow(1, ".lycoris-rows-remove").click());
    const allOn = list(row(true, A, "0.3"), row(true, B, "0.75", CLIP_HALF));
    await step("all on/off (one was off: all on)", allOn, () => editor.locator(".lycoris-rows-all").click());
    await step("all on/off (all were on: all off)", list(row(false, A, "0.3"), row(false, B, "0.75", CLIP_HALF)),
        () => editor.locator(".lycoris-rows-all").click());
    await step("all on/off again", allOn, () => editor.locator(".lycoris-rows-all").click());
    mark("edited");

    // The text by hand: a broken text shows its error and is kept as typed; put right, the rows are back.
    await editor.locator(".lycoris-rows-text-toggle").click();
    const area = editor.locator(".lycoris-rows-textarea");
    const broken = allOn.slice(0, -2);
    await area.fill(broken);
    const bad = await waitFor(page, "the error of a broken rows text", (t) => {
        const state = window.__rowsState(t);
        return state.ok && state.errors.length ? state : { ...state, ok: false };
    }, NODE_TYPE, 5000);
    check(bad.value === broken && bad.rows.length === 0, `a broken text: value ${JSON.stringify(bad.value)}, rows ${JSON.stringify(bad.rows)}`);
    check(/not JSON/.test(bad.errors[0]), `the error says ${JSON.stringify(bad.errors)}`);
    result.broken_error = bad.errors[0];
    await area.fill(allOn);
    const fixed = await expectRows(page, "the text put right by hand", allOn);
    steps.push({ step: "text put right", value: fixed.value });
    result.steps = steps;

    // What is saved: the text, the node's other values as they were, nothing of the editor; and the undo state.
    await area.blur();
    const saved = await waitFor(page, "the change tracker to hold the edited rows", (t) => {
        const state = window.__rowsState(t);
        return state.ok && state.tracked === state.value ? state : { ...state, ok: false };
    }, NODE_TYPE, 5000);
    check(JSON.stringify(saved.saved) === JSON.stringify([allOn, ...original.slice(1)]),
        `saved widgets_values ${JSON.stringify(saved.saved)}, expected ${JSON.stringify([allOn, ...original.slice(1)])}`);
    check(saved.rowsTextareasShown === 0, "the rows textarea shows after the edits");
    result.saved = saved.saved;

    await queueAndWait(page, NODE_TYPE);
    mark("ran");
    const ran = await waitFor(page, "each row's report and the lora_text tag's after the run", (t) => {
        const state = window.__rowsState(t);
        const done = state.ok && state.rows.length === 2 && state.rows.every((r) => r.lines.length) && state.others.length;
        return done ? state : { ...state, ok: false };
    }, NODE_TYPE, 15000);
    result.report = { rows: ran.rows.map((r) => r.lines), others: ran.others, others_lines: ran.othersLines };
    const layout = await settled(page, "the nodes' rectangles after the run", nodeRects, null, { quietMs: 600 });
    check(layout.overlaps.length === 0, `nodes cover each other after the run: ${JSON.stringify(layout)}`);
    check(ran.value === allOn, `the run changed the rows text: ${JSON.stringify(ran.value)}`);

    await reopenUI(page);
    const back = await waitFor(page, "the same rows and report after the reload", (t) => {
        const state = window.__rowsState(t);
        const done = state.ok && state.editorShown && state.rows.length === 2 && state.rows.every((r) => r.lines.length);
        return done ? state : { ...state, ok: false };
    }, NODE_TYPE, 20000);
    check(back.value === allOn, `after the reload the rows text is ${JSON.stringify(back.value)}`);
    check(JSON.stringify(back.rows) === JSON.stringify(ran.rows),
        `after the reload the editor draws ${JSON.stringify(back.rows)}, before it ${JSON.stringify(ran.rows)}`);
    check(back.rowsTextareasShown === 0, "the rows textarea shows after the reload");
    mark("reloaded");
    if (EXPERTS_WORKFLOW) {
        // The rows node's close-up now: the experts workflow replaces it (common.mjs's close-up finds no node then).
        result.node_screenshot = await nodeScreenshot(page, NODE_TYPE, SCREENSHOT.replace(/(\.png)?$/i, "-node.png"));
        await expertsChecks(page, result);
    }
    result.ok = true;
}

runBrowserScript({
    name: "rows.mjs",
    workflowPath: WORKFLOW,
    nodeType: NODE_TYPE,
    closeUp: { scale: 1, top: 120 },
    initScript: `window.__rowsState = ${rowsState};`,
    stateKey: "state",
    readState: (page) => page.evaluate((t) => window.__rowsState?.(t), NODE_TYPE),
    body: checks,
});
