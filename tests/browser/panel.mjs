// The LyCORIS panel in a real browser against a real ComfyUI server.
//
//   COMFY_URL=http://127.0.0.1:8188/ SCREENSHOT=/tmp/panel.png node tests/browser/panel.mjs
//
// Optional env: RENDERER=classic|vue (default classic: the LiteGraph canvas; vue: "Nodes 2.0"),
// WORKFLOW (default example_workflows/lycoris_loader.json), CHROMIUM (default /usr/bin/chromium),
// TIMEOUT_MS for the workflow run (default 180000).
//
// Opens the UI, closes the first-run templates dialog, checks that the node types are registered, loads the example
// workflow, checks the panel's metadata (and, on temporary nodes of the other types, metadata, a refused file and a
// report with problems), queues the workflow, waits for it to finish, checks the coverage line, the chart and the
// trigger chips (a click copies), saves a screenshot (and a close-up of the loader node, "<name>-node.png"), and
// prints one JSON line. Exit 0 = all checks passed; 1 = a check failed (message on stderr and in the JSON line);
// 2 = bad usage. The server must not have the loader's output cached (a fresh server, --cache-none, or POST /free
// {"free_memory": true} before the script, as tests/e2e/test_browser_panel.py does).

import { join } from "node:path";

import {
    REPO, RENDERER, check, loadWorkflow, mark, queueAndWait, runBrowserScript, setRenderer, settled, waitFor, within,
} from "./common.mjs";

// Node types that must be registered: all the pack's.
const NODE_IDS = [
    "LycorisLoader",
    "LycorisLoaderModelOnly",
    "LycorisInfo",
    "LycorisBlockWeights",
    "LycorisBlockInfo",
    "LycorisStack",
    "LycorisApplyStack",
    "LycorisHook",
    "LycorisFade",
];
// Those with the panel (NODE_TYPES in web/lycoris_panel.js): the other-node checks run on each but the loader.
const PANEL_NODE_IDS = ["LycorisLoader", "LycorisLoaderModelOnly", "LycorisInfo", "LycorisBlockWeights", "LycorisBlockInfo"];
const LOADER_TYPE = "LycorisLoader";
const PANEL_WIDGET = "lycoris_panel";
const EXPECT_ALGORITHM = "LoKr";
const EXPECT_COVERAGE = "modules applied";
const CLOSE_UP = { scale: 1.5, top: 120 }; // canvas zoom and place for the node close-up screenshot

const WORKFLOW = process.env.WORKFLOW || join(REPO, "example_workflows", "lycoris_loader.json");

/** Everything the checks need, read in the page. */
function panelState(loaderType) {
    const app = window.comfyAPI.app.app;
    const node = app.graph.nodes.find((n) => n.type === loaderType);
    if (!node) return { ok: false, reason: `no ${loaderType} node in the graph` };
    const widget = node.widgets?.find((w) => w.name === "lycoris_panel");
    if (!widget) return { ok: false, reason: "no lycoris_panel widget", widgets: node.widgets?.map((w) => w.name) };
    const root = widget.element;
    const q = (sel) => [...root.querySelectorAll(sel)];
    const others = node.widgets.filter((w) => w !== widget && !w.hidden && w.type !== "hidden");
    const rect = root.getBoundingClientRect();
    return {
        ok: true,
        nodeId: node.id,
        serialize: widget.serialize,
        inDocument: document.contains(root),
        rect: { x: rect.x, y: rect.y, width: rect.width, height: rect.height },
        rootClass: root.className,
        text: root.innerText,
        algos: q(".lycoris-algos").map((e) => e.textContent),
        coverage: q(".lycoris-coverage").map((e) => e.textContent),
        coverageClass: q(".lycoris-coverage").map((e) => e.className),
        bars: q(".lycoris-chart .lycoris-bar").map((e) => e.style.width),
        triggers: q(".lycoris-trigger").map((e) => e.textContent),
        errors: q(".lycoris-error").map((e) => e.textContent),
        overflowY: root.scrollHeight - root.clientHeight, // > 0: the panel is cut off and scrolls
        layout: {
            nodeHeight: node.size[1],
            panelY: widget.y,
            panelHeight: widget.computedHeight,
            others: others.map((w) => ({ name: w.name, y: w.y, height: w.computedHeight ?? 20 })),
        },
    };
}

/** The panel of a node by id, in the page. */
function panelOf(nodeId) {
    const node = window.comfyAPI.app.app.graph.getNodeById(nodeId);
    const root = node?.widgets?.find((w) => w.name === "lycoris_panel")?.element;
    if (!root) return { ok: false, reason: "no lycoris_panel widget" };
    const q = (sel) => [...root.querySelectorAll(sel)].map((e) => e.textContent);
    return {
        text: root.innerText,
        algos: q(".lycoris-algos"),
        errors: q(".lycoris-error"),
        warn: q(".lycoris-coverage.lycoris-warn"),
        problems: q(".lycoris-problems li"),
        bars: q(".lycoris-chart .lycoris-bar").length,
    };
}

async function checks({ page, result, workflow, original, pageErrors, consoleErrors }) {
    const registered = await page.evaluate(
        (ids) => ids.filter((id) => id in window.LiteGraph.registered_node_types),
        NODE_IDS,
    );
    result.registered = registered;
    for (const id of NODE_IDS) {
        check(registered.includes(id), `node type ${id} is not registered; registered LyCORIS types: ${registered}`);
    }

    await setRenderer(page);
    await loadWorkflow(page, workflow);

    // Before any run: the panel exists, is not serialized, and shows the file's metadata from /lycoris/info.
    const before = await waitFor(
        page,
        `the panel to show metadata containing "${EXPECT_ALGORITHM}"`,
        ([type, algo]) => {
            const s = window.__lycorisPanelState(type);
            return s.ok && s.algos.join(" ").includes(algo) ? s : { ...s, ok: false };
        },
        [LOADER_TYPE, EXPECT_ALGORITHM],
    );
    check(before.serialize === false, `the ${PANEL_WIDGET} widget must have serialize === false`);
    mark("metadata_shown");

    const others = PANEL_NODE_IDS.filter((id) => id !== LOADER_TYPE);
    result.other_nodes = await checkOtherNodes(page, others, original[0], pageErrors);
    mark("other_nodes_checked");

    const saved = await page.evaluate((type) => {
        const app = window.comfyAPI.app.app;
        return app.graph.serialize().nodes.find((n) => n.type === type)?.widgets_values;
    }, LOADER_TYPE);
    check(
        JSON.stringify(saved) === JSON.stringify(original),
        `widgets_values changed by the panel: ${JSON.stringify(saved)} != ${JSON.stringify(original)}`,
    );

    // Queue the workflow and wait for the run to finish (the loader must run, not come from the cache).
    await queueAndWait(page, LOADER_TYPE);
    mark("run_finished");

    await waitFor(
        page,
        `the coverage line ("${EXPECT_COVERAGE}") and the chart`,
        ([type, cov]) => {
            const s = window.__lycorisPanelState(type);
            return s.ok && s.coverage.join(" ").includes(cov) && s.bars.length > 0 ? s : { ...s, ok: false };
        },
        [LOADER_TYPE, EXPECT_COVERAGE],
    );
    // The report grows the node over the next frames: its layout is checked once the panel stops changing.
    const after = await settled(page, "the panel after the run", (type) => window.__lycorisPanelState(type), LOADER_TYPE);
    check(after.inDocument, "the panel element is not in the page");
    const { rect } = after;
    check(rect.width > 50 && rect.height > 30, `the panel is not visible: ${JSON.stringify(rect)}`);
    check(after.triggers.length > 0, `no trigger word chips; panel text: ${after.text}`);
    check(after.errors.length === 0, `the panel shows an error: ${after.errors}`);
    if (RENDERER === "classic") {
        const { nodeHeight, panelY, panelHeight, others } = after.layout;
        for (const w of others) {
            const overlap = `widget ${w.name} (y ${w.y}+${w.height}) overlaps the panel (y ${panelY})`;
            check(w.y + w.height <= panelY + 1, overlap);
        }
        const outside = `the panel (y ${panelY}+${panelHeight}) sticks out of the node (height ${nodeHeight})`;
        check(panelY + panelHeight <= nodeHeight + 1, outside);
        check(after.overflowY <= 1, `the panel's content is ${after.overflowY} px taller than the panel`);
    }

    // Click the first trigger chip like a user: it must not throw, must say "copied", and fill the clipboard.
    const errorsBeforeClick = pageErrors.length;
    const chip = page.locator(`.lycoris-panel[data-node-id="${after.nodeId}"] .lycoris-trigger`).first();
    await chip.click({ timeout: within(5000) });
    const copied = await waitFor(
        page,
        'the "copied" note after clicking a trigger word',
        (id) => {
            const status = document.querySelector(`.lycoris-panel[data-node-id="${id}"] .lycoris-copied`);
            return status?.textContent || false;
        },
        after.nodeId,
        5000,
    );
    const thrown = pageErrors.slice(errorsBeforeClick);
    check(thrown.length === 0, `clicking a trigger chip threw: ${thrown}`);
    check(copied === "copied", `clicking a trigger chip said "${copied}"`);
    const clipboard = await page.evaluate(() => navigator.clipboard.readText().catch((e) => `<unreadable: ${e}>`));
    const word = after.triggers[0];
    check(clipboard === word, `the clipboard holds ${JSON.stringify(clipboard)}, not ${JSON.stringify(word)}`);

    const ours = pageErrors.filter((e) => /lycoris/i.test(e));
    check(ours.length === 0, `page errors from the extension: ${ours.join("\n")}`);
    const oursConsole = consoleErrors.filter((e) => /lycoris/i.test(e));
    check(oursConsole.length === 0, `console errors about lycoris: ${oursConsole.join("\n")}`);

    Object.assign(result, {
        ok: true,
        algos: after.algos,
        coverage: after.coverage,
        coverage_class: after.coverageClass,
        bars: after.bars.length,
        triggers: after.triggers,
        clipboard,
        panel_text: after.text,
    });
}

/**
 * On a temporary node of each other type: the panel shows the file's metadata; a file the route refuses shows its
 * error text (no exception); a report with problems is styled as a warning and lists at most 5 of them. The nodes are
 * removed again before the workflow is queued.
 */
async function checkOtherNodes(page, types, fileName, pageErrors) {
    const errorsBefore = pageErrors.length;
    const out = {};
    const choose = (nodeId, name) =>
        page.evaluate(
            ([id, value]) => {
                // As the combo does when a user picks a file: set the value, call the widget's callback.
                const node = window.comfyAPI.app.app.graph.getNodeById(id);
                const w = node.widgets.find((x) => x.name === "lycoris_name");
                w.value = value;
                w.callback?.(value);
            },
            [nodeId, name],
        );
    for (const type of types) {
        const id = await page.evaluate((t) => {
            const app = window.comfyAPI.app.app;
            const node = window.LiteGraph.createNode(t);
            node.pos = [60, 700];
            app.graph.add(node);
            return node.id;
        }, type);
        await choose(id, fileName);
        await waitFor(page, `${type}: metadata in its panel`, ([nodeId, algo]) => {
            const s = window.__lycorisPanelOf(nodeId);
            return s.algos?.join(" ").includes(algo) ? s : { ...s, ok: false };
        }, [id, EXPECT_ALGORITHM]);

        // A name the route refuses: the panel shows the error, nothing throws.
        await choose(id, "no_such_file.safetensors");
        const refused = await waitFor(page, `${type}: the route's error in its panel`, (nodeId) => {
            const s = window.__lycorisPanelOf(nodeId);
            return s.errors?.length ? s : { ...s, ok: false };
        }, id);

        // A run with problems (an injected report): amber, at most 5 problems listed, then "… and N more".
        const problems = Array.from({ length: 7 }, (_, i) => [`lora_unet_fake_${i}`, "no such weight in the model"]);
        const warned = await page.evaluate(
            ([nodeId, probs]) => {
                const node = window.comfyAPI.app.app.graph.getNodeById(nodeId);
                node.onExecuted({
                    lycoris: [{
                        line: "fake.safetensors: 58/65 modules applied (LoKr 58)", applied: 58, total: 65,
                        problems: probs, blocks: [{ name: "input_blocks.1", change: 0.02, modules: 3 }], summary: null,
                    }],
                });
                return window.__lycorisPanelOf(nodeId);
            },
            [id, problems],
        );
        check(warned.warn.length === 1, `${type}: a report with problems is not styled as a warning: ${warned.text}`);
        check(
            warned.problems.length === 6 && warned.problems[5].includes("2 more"),
            `${type}: expected 5 problems and "… and 2 more", got ${JSON.stringify(warned.problems)}`,
        );
        check(warned.bars === 1, `${type}: expected 1 bar for the injected report, got ${warned.bars}`);

        // A run that applied everything but had to assume or lose something (report.warnings): amber, shown.
        const warning = "3 patches were merged into quantized weights (fp8 e4m3fn 3): the merge re-rounds W+ΔW";
        const assumed = await page.evaluate(
            ([nodeId, text]) => {
                const node = window.comfyAPI.app.app.graph.getNodeById(nodeId);
                node.onExecuted({
                    lycoris: [{
                        line: "fp8.safetensors: 3/3 modules applied (LoCon 3)", applied: 3, total: 3, problems: [],
                        warnings: [text], blocks: [{ name: "input_blocks.1", change: 0.02, modules: 3 }], summary: null,
                    }],
                });
                return window.__lycorisPanelOf(nodeId);
            },
            [id, warning],
        );
        check(assumed.warn.length === 1, `${type}: a report with warnings is not styled as a warning: ${assumed.text}`);
        check(assumed.text.includes(warning), `${type}: the report's warning is not shown: ${assumed.text}`);
        await page.evaluate((nodeId) => {
            const graph = window.comfyAPI.app.app.graph;
            graph.remove(graph.getNodeById(nodeId));
        }, id);
        out[type] = { metadata: true, route_error: refused.errors[0], problems_listed: warned.problems.length };
    }
    check(pageErrors.length === errorsBefore, `page errors on the other nodes: ${pageErrors.slice(errorsBefore)}`);
    return out;
}

runBrowserScript({
    name: "panel.mjs",
    workflowPath: WORKFLOW,
    nodeType: LOADER_TYPE,
    closeUp: CLOSE_UP,
    // The state readers, in every page before its scripts run.
    initScript: `window.__lycorisPanelState = ${panelState}; window.__lycorisPanelOf = ${panelOf};`,
    clipboard: true,
    stateKey: "panel",
    readState: (page) => page.evaluate((t) => window.__lycorisPanelState?.(t), LOADER_TYPE),
    body: checks,
});
