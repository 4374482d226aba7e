// Every example workflow run in a real browser, then its nodes measured: none may cover another after the run
// (tests/e2e/test_browser_templates.py).
//
//   COMFY_URL=http://127.0.0.1:8188/ SCREENSHOT=/tmp/t.png RENDERER=vue WORKFLOWS=/tmp/demo.json SHOTS=/tmp/shots \
//       node tests/browser/templates.mjs
//
// Env (besides common.mjs's): WORKFLOWS, a JSON file {name: workflow}: the examples as the tests run them on the tiny
// model (scripts/example_models.py for_demo; the tools' output names made unique per run by the caller); SHOTS, the
// folder for one screenshot per example after its run (<name>.png, the whole graph in view).
//
// For each example: load it, queue it (unless it is in LOAD_ONLY, a comma-separated list), wait for the run and for the nodes to stop growing (the panels and reports
// are filled by the run), then read every node's rectangle as drawn (the Vue renderer: its element; classic: title
// bar + body from pos and size) and list each pair that intersects. The result has, per example, the rectangles
// and the overlaps; the caller asserts none. On the tools' nodes it also reads their report widget (web/
// lycoris_panel.js, "lycoris_report") once it is on screen before the run and once it shows the run's report: the
// caller checks the hint before, the report after, that the widget adds nothing to the saved workflow, and that
// the page threw nothing while the tool's example loaded and ran (each example's page errors are kept).

import { mkdirSync, readFileSync } from "node:fs";
import { join } from "node:path";

import {
    REPO, check, graphLayout, loadWorkflow, mark, nodeRects, queueAndWait, reopenUI, runBrowserScript, setRenderer, settled,
    waitFor,
} from "./common.mjs";

const WORKFLOWS = JSON.parse(readFileSync(process.env.WORKFLOWS, "utf8"));
const SHOTS = process.env.SHOTS;
const SETTLE_MS = 600; // the rectangles must stay the same this long (and over 3 rendered frames) to count as final
// After this example's run the page is reloaded: its panels must show the run's report again without a new run.
const RELOAD_AFTER = process.env.RELOAD_AFTER || "lycoris_loader";
// Examples opened and laid out but not queued: the tiny models cannot stand in for theirs (example_models.LOAD_ONLY).
const LOAD_ONLY = (process.env.LOAD_ONLY || "").split(",").filter(Boolean);
const TOOL_TYPES = ["LycorisSave", "LycorisResize", "LycorisExtract", "LycorisConvert"];

/** The coverage lines and notes of every panel in the graph, by node id. */
function panelLines() {
    const out = {};
    for (const node of window.comfyAPI.app.app.graph.nodes) {
        const root = node.widgets?.find((w) => w.name === "lycoris_panel")?.element;
        if (!root) continue;
        const q = (sel) => [...root.querySelectorAll(sel)].map((e) => e.textContent);
        out[node.id] = { lines: q(".lycoris-coverage .lycoris-line"), notes: q(".lycoris-cached"), text: root.innerText };
    }
    return out;
}

/** Each tool node's report widget, by node id: its text, whether it is the idle hint, on screen, and the node's
 * widget values as the frontend saves them. */
function toolReports(types) {
    const app = window.comfyAPI.app.app;
    const saved = app.graph.serialize().nodes;
    const out = {};
    for (const node of app.graph.nodes.filter((n) => types.includes(n.type))) {
        const widget = node.widgets?.find((w) => w.name === "lycoris_report");
        const text = widget?.element?.querySelector(".lycoris-report-text");
        const rect = text?.getBoundingClientRect();
        out[node.id] = {
            type: node.type,
            text: text?.textContent ?? null,
            idle: !!text?.classList.contains("lycoris-idle"),
            visible: !!rect && rect.width > 0 && rect.height > 0 && text.offsetParent !== null,
            saved: saved.find((n) => String(n.id) === String(node.id))?.widgets_values,
        };
    }
    return out;
}

/** toolReports once every tool node's report satisfies `want` ("shown": on screen; "ran": on screen, not idle). */
const toolReportsWhen = (page, what, want) => waitFor(page, what, ([types, w]) => {
    const reports = window.__templatesToolReports(types);
    const ok = Object.values(reports).every((r) => r.visible && (w === "shown" || !r.idle));
    return ok ? { reports } : { ok: false, reports };
}, [TOOL_TYPES, want]);

/** The whole graph in view, as the frontend's "fit view" does. `settle`: wait for the DOM widgets and Vue nodes to
 * follow the canvas (not needed before settledRects, which waits for the rectangles to stop changing). */
async function fitView(page, settle = false) {
    await page.evaluate(() => {
        const app = window.comfyAPI.app.app;
        const nodes = app.graph.nodes;
        const title = window.LiteGraph.NODE_TITLE_HEIGHT;
        const x0 = Math.min(...nodes.map((n) => n.pos[0]));
        const y0 = Math.min(...nodes.map((n) => n.pos[1] - title));
        const x1 = Math.max(...nodes.map((n) => n.pos[0] + n.size[0]));
        const y1 = Math.max(...nodes.map((n) => n.pos[1] + n.size[1]));
        const ds = app.canvas.ds;
        const rect = app.canvas.canvas.getBoundingClientRect();
        const pad = 40;
        const left = 100; // the sidebar's icons are drawn over the canvas's left edge
        ds.scale = Math.min(1, (rect.width - left - pad) / (x1 - x0), (rect.height - 2 * pad) / (y1 - y0));
        ds.offset[0] = left / ds.scale - x0;
        ds.offset[1] = pad / ds.scale - y0;
        app.canvas.setDirty(true, true);
    });
    if (settle) await settled(page, "the nodes after fitting the view", graphLayout); // the Vue nodes follow it
}

/** nodeRects once it is the same for SETTLE_MS (panels fill and nodes grow over a few frames after a run). */
const settledRects = (page) => settled(page, "the nodes' rectangles", nodeRects, null, { quietMs: SETTLE_MS, timeout: 20000 });

/** Reload the page (the frontend restores the open workflow): each panel shows the report it showed after the run. */
async function reloadKeepsReports(page) {
    const ran = await page.evaluate(panelLines);
    check(Object.values(ran).some((p) => p.lines.length), `no panel shows a report after the run: ${JSON.stringify(ran)}`);
    await reopenUI(page);
    const restored = await waitFor(page, "the panels to show the last run's report after the reload", (want) => {
        const now = window.__templatesPanelLines();
        const same = Object.entries(want).every(([id, p]) => JSON.stringify(now[id]?.lines) === JSON.stringify(p.lines));
        return same ? now : { ok: false, now };
    }, ran, 20000);
    return { ran, restored };
}

await runBrowserScript({
    name: "templates.mjs",
    workflowPath: join(REPO, "example_workflows", "lycoris_loader.json"),
    nodeType: "LycorisLoader",
    closeUp: { scale: 1, top: 120 },
    initScript: `window.__templatesPanelLines = ${panelLines}; window.__templatesToolReports = ${toolReports};`,
    async body({ page, result, pageErrors }) {
        await setRenderer(page);
        mkdirSync(SHOTS, { recursive: true });
        result.examples = {};
        for (const [name, workflow] of Object.entries(WORKFLOWS)) {
            const errorsBefore = pageErrors.length;
            await loadWorkflow(page, workflow);
            await waitFor(page, `${name} to load`, (n) => window.comfyAPI.app.app.graph.nodes.length === n, workflow.nodes.length);
            await fitView(page);
            const toolsBefore = await toolReportsWhen(page, `${name}'s tool reports on screen`, "shown");
            const before = await settledRects(page);
            const ran = !LOAD_ONLY.includes(name);
            let toolsAfter = toolsBefore;
            let after = before;
            if (ran) {
                await queueAndWait(page);
                mark(`ran_${name}`);
                await fitView(page);
                toolsAfter = await toolReportsWhen(page, `${name}'s tool reports after the run`, "ran");
                after = await settledRects(page);
            }
            await fitView(page, true); // the grown graph in view for the picture
            await page.mouse.move(5, 995);
            await page.screenshot({ path: join(SHOTS, `${name}.png`) });
            result.examples[name] = {
                ran,
                before: before.overlaps, after: after.overlaps, rects: after.rects,
                tools: { before: toolsBefore.reports, after: toolsAfter.reports },
                page_errors: pageErrors.slice(errorsBefore),
            };
            if (name === RELOAD_AFTER) result.reload = await reloadKeepsReports(page);
        }
        const bad = Object.entries(result.examples).filter(([, e]) => e.after.length || e.before.length);
        check(!bad.length, `nodes cover each other: ${JSON.stringify(bad.map(([n, e]) => [n, e.before, e.after]))}`);
        result.ok = true;
    },
});
