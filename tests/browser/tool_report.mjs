// The tools' report on the node (web/lycoris_panel.js, widget "lycoris_report") in a real browser against a real
// ComfyUI server.
//
//   COMFY_URL=http://127.0.0.1:8188/ SCREENSHOT=/tmp/tool.png WORKFLOW=<demo lycoris_extract.json> node tests/browser/tool_report.mjs
//
// Optional env: RENDERER=classic|vue (default classic), NODE_TYPE (default LycorisExtract), CHROMIUM, TIMEOUT_MS.
//
// Loads the workflow (a tool's example on the demo files, whose output file must not exist yet: the tools never
// overwrite), checks the report widget is on the node, visible, with its hint and not in the saved workflow, queues
// the workflow, waits for it, and checks the widget shows the node's report: the text the server sent as the node's
// "text" UI output, lines kept. Prints one JSON line; exit 0 = all checks passed, 1 = a check failed, 2 = bad usage.

import { join } from "node:path";

import { REPO, check, loadWorkflow, mark, queueAndWait, runBrowserScript, setRenderer, waitFor } from "./common.mjs";

const NODE_TYPE = process.env.NODE_TYPE || "LycorisExtract";
const WORKFLOW = process.env.WORKFLOW || join(REPO, "example_workflows", "lycoris_extract.json");
const CLOSE_UP = { scale: 1.1, top: 130 };

/** The tool node's report widget, read in the page. */
function reportState(nodeType) {
    const app = window.comfyAPI.app.app;
    const node = app.graph.nodes.find((n) => n.type === nodeType);
    if (!node) return { ok: false, reason: `no ${nodeType} node` };
    const widget = node.widgets?.find((w) => w.name === "lycoris_report");
    if (!widget) return { ok: false, reason: "no lycoris_report widget", widgets: node.widgets?.map((w) => w.name) };
    const text = widget.element.querySelector(".lycoris-report-text");
    const rect = text?.getBoundingClientRect();
    return {
        ok: true,
        nodeId: node.id,
        text: text?.textContent ?? null,
        idle: !!text?.classList.contains("lycoris-idle"),
        // On screen, in whichever renderer draws the node.
        visible: !!rect && rect.width > 0 && rect.height > 0 && text.offsetParent !== null,
        saved: app.graph.serialize().nodes.find((n) => String(n.id) === String(node.id))?.widgets_values,
    };
}

async function checks({ page, result, original, workflow, pageErrors }) {
    await setRenderer(page);
    await loadWorkflow(page, workflow);
    const before = await waitFor(page, "the report widget on screen", (t) => {
        const s = window.__lycorisReportState(t);
        return s.ok && s.visible ? s : { ...s, ok: false };
    }, NODE_TYPE);
    check(before.idle && before.text.includes("Run to write the file"), `before a run: ${JSON.stringify(before)}`);
    check(JSON.stringify(before.saved) === JSON.stringify(original),
        `the saved widget values changed: ${JSON.stringify(before.saved)} vs ${JSON.stringify(original)}`);

    await queueAndWait(page);
    mark("ran");
    const after = await waitFor(page, "the report on the node after the run", (t) => {
        const s = window.__lycorisReportState(t);
        return s.ok && !s.idle ? s : { ...s, ok: false };
    }, NODE_TYPE);
    check(after.visible, "the report is not on screen after the run");
    // The node's own report (ToolReport.text): first the file it wrote, then a line per module.
    const output = original.find((v) => typeof v === "string" && v.startsWith("lycoris/"));
    check(output && after.text.includes(output), `the report does not name ${output}: ${after.text.slice(0, 300)}`);
    check(after.text.split("\n").length >= 2, `one line only: ${after.text}`);
    result.report = after.text.split("\n").slice(0, 4);
    check(pageErrors.length === 0, `page errors: ${pageErrors.join(" | ").slice(0, 500)}`);
    result.ok = true;
}

runBrowserScript({
    name: "tool_report.mjs",
    workflowPath: WORKFLOW,
    nodeType: NODE_TYPE,
    closeUp: CLOSE_UP,
    initScript: `window.__lycorisReportState = ${reportState};`,
    stateKey: "state",
    readState: (page) => page.evaluate((t) => window.__lycorisReportState?.(t), NODE_TYPE),
    body: checks,
});
