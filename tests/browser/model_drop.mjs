// A LoRA dragged from the model library onto the canvas, as a user would, in a real browser against a real ComfyUI
// server (tests/e2e/test_browser_model_drop.py).
//
//   COMFY_URL=http://127.0.0.1:8188/ SCREENSHOT=/tmp/drop.png RENDERER=classic node tests/browser/model_drop.mjs
//
// Env (besides common.mjs's): LORA, the file in the server's loras folder to drag (default demo_loha_te.safetensors,
// a LoHa: the panel's metadata must say "LoHa").
//
// web/lycoris_panel.js adds the pack's node types with a lycoris_name combo to the frontend's model-to-node table
// (registerModelDrops). On the loader example (example_workflows/lycoris_loader.json), with the model library
// sidebar open and its "loras" folder expanded, the file's leaf is dragged with the real mouse (down on the leaf,
// moves in steps, up on the target):
// (a) onto_node: onto the LycorisLoader node's body: its lycoris_name takes the file, no node is added, and its panel
//     shows the file's metadata ("LoHa"). Skipped in the Vue renderer of a frontend with no drop target on the Vue
//     nodes (1.32.9, 1.49.6: the frontend's own limitation; 1.58.1 has one).
// (b) canvas_default: onto empty canvas, LycorisNodes.ModelLibrary.DropOnCanvas at its default: ComfyUI's own
//     LoraLoader is added with lora_name = the file (the core drop unchanged).
// (c) canvas_lycoris: the same after the setting is set to "LyCORIS Loader": a LycorisLoader is added with
//     lycoris_name = the file. The setting is set back to its default at the end, whatever happened.
// (d) everywhere_setting: the pack's other setting, LycorisNodes.ExactEverywhere (off by default), switched on and
//     off again as the settings dialog does: the server stores each value, and each switch sends one POST /free (the
//     loaders' kept outputs are dropped, so the next queue loads every LoRA the new way).
// Each case's outcome is in the JSON line (result.cases); every case runs, and the failures are reported together.
// Exit 0 = all checks passed, 1 = a check failed, 2 = bad usage.

import { join } from "node:path";

import {
    REPO, check, closeDialogs, frames, graphLayout, loadWorkflow, mark, runBrowserScript, setRenderer, settled, waitFor,
    within,
} from "./common.mjs";

const WORKFLOW = join(REPO, "example_workflows", "lycoris_loader.json");
const LOADER_TYPE = "LycorisLoader";
const NAME_WIDGET = "lycoris_name";
const CORE_TYPE = "LoraLoader";
const CORE_WIDGET = "lora_name";
const PANEL_WIDGET = "lycoris_panel";
const FOLDER = "loras";
const LORA = process.env.LORA || "demo_loha_te.safetensors";
const EXPECT_TEXT = "LoHa";
const SETTING = "LycorisNodes.ModelLibrary.DropOnCanvas";
const SETTING_DEFAULT = "ComfyUI's Load LoRA";
const SETTING_OURS = "LyCORIS Loader";
const EVERYWHERE = "LycorisNodes.ExactEverywhere";

// The sidebar button: 1.32.9 and 1.49.6 mark it with the class "<tab id>-tab-button", 1.58.1 with a data-testid.
const LIBRARY_BUTTON = '[data-testid="model-library-tab-button"], .model-library-tab-button';
// A tree node by its key ("root/loras/<file>"): 1.49.6 and 1.58.1 give each a data-testid; 1.32.9 none (see treeItem).
const TREE_NODE = (key) => `[data-testid="tree-node-${key}"]`;

/** The graph's nodes, the pack's registrations in the drop table, and whether Vue nodes have a drop target. */
function pageState({ folder, panelWidget }) {
    const app = window.comfyAPI.app.app;
    let providers = null;
    try {
        const pinia = document.querySelector("#vue-app")?.__vue_app__?.config?.globalProperties?.$pinia;
        const store = pinia?._s?.get?.("modelToNode");
        providers = store?.getAllNodeProviders?.(folder)?.map((p) => `${p.nodeDef?.name}:${p.key}`) ?? null;
    } catch (e) {
        providers = String(e);
    }
    const vueNode = document.querySelector(".lg-node[data-node-id]");
    return {
        nodes: app.graph.nodes.map((n) => {
            const panel = n.widgets?.find((w) => w.name === panelWidget)?.element;
            return {
                id: n.id,
                type: n.comfyClass ?? n.type,
                widgets: Object.fromEntries((n.widgets ?? [])
                    .filter((w) => typeof w.value === "string" && w.name !== panelWidget)
                    .map((w) => [w.name, w.value])),
                ...(panel ? { panel: panel.textContent } : {}),
            };
        }),
        providers,
        vue_nodes: !!vueNode,
        // Frontend 1.58.1 makes the Vue nodes' transform pane a drop target; 1.32.9 and 1.49.6 do not.
        vue_node_drop_target: vueNode ? !!vueNode.closest("[data-drop-target-for-element]") : null,
    };
}

/**
 * A point (page px) in the middle of the node `id`'s panel, where a user aims: in the classic renderer the panel is
 * a DOM element over the canvas, which is the drop target, so the panel must let a drag through to it.
 */
function nodeBodyPoint(id) {
    const app = window.comfyAPI.app.app;
    const canvas = app.canvas;
    const node = app.graph.getNodeById(id);
    const rect = canvas.canvas.getBoundingClientRect();
    const [x0, y0] = canvas.ds.convertOffsetToCanvas([node.pos[0], node.pos[1]]);
    const s = canvas.ds.scale;
    const panel = node.widgets?.find((w) => w.name === "lycoris_panel")?.element?.getBoundingClientRect();
    const onPanel = panel && panel.width > 0 && panel.height > 0;
    const x = onPanel ? panel.left + panel.width / 2 : rect.left + x0 + (node.size[0] * s) / 2;
    const y = onPanel ? panel.top + panel.height / 2 : rect.top + y0 + Math.min(20 * s, (node.size[1] * s) / 3);
    const at = canvas.ds.convertCanvasToOffset([x - rect.left, y - rect.top]);
    const hit = document.elementFromPoint(x, y);
    return {
        x: Math.round(x),
        y: Math.round(y),
        on_panel: !!onPanel,
        node_at_point: app.canvas.graph?.getNodeOnPos(at[0], at[1])?.id ?? null,
        element: hit === canvas.canvas ? "canvas" : hit?.closest(".lg-node") ? "vue node" : hit?.outerHTML.slice(0, 120),
        drop_target: !!hit?.closest("[data-drop-target-for-element]"),
    };
}

/** Pan the canvas so the node `id` is at 65 % of its width, 40 % of its height. */
function panTo(id) {
    const app = window.comfyAPI.app.app;
    const canvas = app.canvas;
    const node = app.graph.getNodeById(id);
    const rect = canvas.canvas.getBoundingClientRect();
    const s = canvas.ds.scale;
    canvas.ds.offset[0] = (rect.width * 0.65) / s - (node.pos[0] + node.size[0] / 2);
    canvas.ds.offset[1] = (rect.height * 0.4) / s - (node.pos[1] + node.size[1] / 2);
    canvas.setDirty(true, true);
}

/** A point (page px) on empty canvas: the canvas itself under it, no node within 80 px (a new node goes there). */
function emptyCanvasPoint() {
    const app = window.comfyAPI.app.app;
    const canvas = app.canvas;
    const rect = canvas.canvas.getBoundingClientRect();
    const s = canvas.ds.scale;
    const clear = (x, y) => {
        if (document.elementFromPoint(x, y) !== canvas.canvas) return false;
        for (const [dx, dy] of [[0, 0], [-80, -80], [80, -80], [-80, 80], [80, 80], [0, 120], [160, 0], [160, 120]]) {
            const [gx, gy] = canvas.ds.convertCanvasToOffset([x + dx - rect.left, y + dy - rect.top]);
            if (app.canvas.graph?.getNodeOnPos(gx, gy)) return false;
            const hit = document.elementFromPoint(x + dx, y + dy);
            if (hit && hit !== canvas.canvas && !hit.closest?.("#graph-canvas")) return false;
        }
        return true;
    };
    for (let y = rect.top + rect.height * 0.55; y < rect.bottom - 160; y += 40) {
        // Right of the middle: clear of the library and of 1.32.9's leaf preview beside it (see ontoNode).
        for (let x = rect.left + rect.width * 0.5; x < rect.right - 200; x += 40) {
            if (clear(x, y)) return { x: Math.round(x), y: Math.round(y), scale: s };
        }
    }
    for (let y = rect.top + 100; y < rect.bottom - 160; y += 40) {
        for (let x = rect.left + 100; x < rect.right - 200; x += 40) {
            if (clear(x, y)) return { x: Math.round(x), y: Math.round(y), scale: s };
        }
    }
    return { ok: false, reason: "no empty canvas on screen", rect: [rect.left, rect.top, rect.width, rect.height] };
}

/** Open the model library and expand its loras folder, as a user would; return the file's leaf (a locator). */
async function openLibrary(page, result) {
    const tree = page.locator(".model-lib-tree-explorer");
    if (!(await tree.first().isVisible().catch(() => false))) {
        await page.locator(LIBRARY_BUTTON).first().click({ timeout: within(10000) });
    }
    await tree.first().waitFor({ state: "visible", timeout: within(15000) });
    const folder = await treeItem(page, `root/${FOLDER}`, [FOLDER], false);
    const leafKey = `root/${FOLDER}/${LORA}`;
    // The leaf's label is the file's title (its metadata's modelspec.title, once loaded) or its name without the
    // extension (Comfy.ModelLibrary.NameFormat): either, for the frontend without data-testids.
    const title = await page.evaluate(async ([folderName, file]) => {
        const r = await window.comfyAPI.api.api.fetchApi(`/view_metadata/${folderName}?filename=${encodeURIComponent(file)}`);
        return r.ok ? (await r.json())?.["modelspec.title"] ?? null : null;
    }, [FOLDER, LORA]);
    const labels = [LORA.replace(/\.[^.]+$/, ""), ...(title ? [title] : [])];
    let leaf = await treeItem(page, leafKey, labels, true, 1000);
    if (!leaf) {
        await folder.click({ timeout: within(5000) }); // the folder's leaves are loaded when it is expanded
        leaf = await treeItem(page, leafKey, labels, true, 15000);
    }
    check(leaf, `the model library shows no ${leafKey} (labels ${JSON.stringify(labels)}) after ${FOLDER} was expanded`);
    await leaf.scrollIntoViewIfNeeded();
    result.library = { leaf_key: leafKey, leaf_text: (await leaf.innerText()).trim().slice(0, 120) };
    mark("library_open");
    return leaf;
}

/**
 * A tree node by its data-testid (1.49.6, 1.58.1), else (1.32.9) the folder/leaf whose label is one of `labels`;
 * looked for up to within(timeout).
 */
async function treeItem(page, key, labels, leaf, timeout = 15000) {
    const byId = page.locator(TREE_NODE(key));
    const byLabel = page
        .locator(`.model-lib-tree-explorer ${leaf ? ".tree-leaf" : ".tree-folder"}`)
        .filter({ has: page.locator(".node-label", { hasText: new RegExp(`^\\s*(${labels.map(escape).join("|")})\\s*$`) }) });
    const deadline = Date.now() + within(timeout);
    do {
        if (await byId.count()) return byId.first();
        if (await byLabel.count()) return byLabel.first();
        await page.waitForTimeout(200);
    } while (Date.now() < deadline);
    return leaf ? null : byId.first(); // a folder that never showed: the click on it fails with the selector
}

const escape = (s) => s.replace(/[.*+?^${}()|[\]\\]/g, "\\$&");

/** The real drag: the mouse down on the leaf, moved in steps to the point, released there. */
async function drag(page, leaf, to) {
    await page.keyboard.press("Escape").catch(() => {}); // no menu or tooltip left open over the target
    const box = await leaf.boundingBox();
    check(box, "the leaf has no box on the page");
    const from = { x: box.x + Math.min(40, box.width / 2), y: box.y + box.height / 2 };
    await page.mouse.move(from.x, from.y);
    await page.waitForTimeout(150); // hover (the library loads the file's metadata then)
    await page.mouse.down();
    await page.mouse.move(from.x + 12, from.y + 4, { steps: 3 }); // past the drag threshold: dragstart
    await page.mouse.move(to.x, to.y, { steps: 12 });
    await page.waitForTimeout(100);
    await page.mouse.up();
    await page.waitForTimeout(50);
    const events = await page.evaluate(() => window.__dropTestEvents?.splice(0) ?? null);
    return {
        events, from: { x: Math.round(from.x), y: Math.round(from.y) }, to: { x: to.x, y: to.y } };
}

/** The nodes added since `before` (node records of pageState). */
function added(before, after) {
    const ids = new Set(before.nodes.map((n) => n.id));
    return after.nodes.filter((n) => !ids.has(n.id));
}

/** Poll pageState until `want(state)` is true (or within(timeout)); return the last state either way. */
async function settle(page, want, timeout) {
    const deadline = Date.now() + within(timeout);
    let state;
    do {
        state = await page.evaluate(pageState, { folder: FOLDER, panelWidget: PANEL_WIDGET });
        if (want(state)) return state;
        await page.waitForTimeout(150);
    } while (Date.now() < deadline);
    return state;
}

async function removeNodes(page, ids) {
    await page.evaluate((list) => {
        const app = window.comfyAPI.app.app;
        for (const id of list) {
            const node = app.graph.getNodeById(id);
            if (node) app.graph.remove(node);
        }
        app.canvas.setDirty(true, true);
    }, ids);
    await settled(page, "the graph after removing the dropped nodes", graphLayout);
}

async function setSetting(page, value) {
    await page.evaluate(([id, v]) => window.comfyAPI.app.app.extensionManager.setting.set(id, v), [SETTING, value]);
}

/** (a) onto the loader's body. */
async function ontoNode(page, leaf, state) {
    const out = { case: "onto_node" };
    if (state.vue_nodes && !state.vue_node_drop_target) {
        out.skipped = `skipped: frontend ${state.frontend} has no drop target on Vue nodes`;
        return out;
    }
    const loader = state.nodes.find((n) => n.type === LOADER_TYPE);
    // Frontend 1.32.9 shows a hovered leaf's preview (400 px wide) right of the library, and it stays up during the
    // drag: a node just beside the library is under it. Pan the graph, as a user would, to bring the loader well
    // right of it.
    await page.evaluate(panTo, loader.id);
    await settled(page, "the nodes after panning to the loader", graphLayout); // the Vue nodes follow the canvas
    const target = await page.evaluate(nodeBodyPoint, loader.id);
    out.target = target;
    out.before = { [NAME_WIDGET]: loader.widgets[NAME_WIDGET], nodes: state.nodes.length };
    out.drag = await drag(page, leaf, target);
    const after = await settle(
        page,
        (s) => s.nodes.find((n) => n.id === loader.id)?.panel?.includes(EXPECT_TEXT) || added(state, s).length > 0,
        8000,
    );
    const node = after.nodes.find((n) => n.id === loader.id);
    out.after = { [NAME_WIDGET]: node?.widgets[NAME_WIDGET], nodes: after.nodes.length, panel: node?.panel };
    out.added = added(state, after).map((n) => ({ type: n.type, widgets: n.widgets }));
    out.problems = [];
    if (target.node_at_point !== loader.id) out.problems.push(`the drop point is not on the loader: ${JSON.stringify(target)}`);
    if (node?.widgets[NAME_WIDGET] !== LORA) out.problems.push(`its ${NAME_WIDGET} is ${node?.widgets[NAME_WIDGET]}, not ${LORA}`);
    if (out.added.length) out.problems.push(`the drop added ${JSON.stringify(out.added)}`);
    if (!node?.panel?.includes(EXPECT_TEXT)) out.problems.push(`its panel does not say ${EXPECT_TEXT}: ${node?.panel}`);
    await removeNodes(page, out.added.length ? added(state, after).map((n) => n.id) : []);
    return out;
}

/** (b), (c): onto empty canvas; expect one new node of `type` whose `widget` is the file. */
async function ontoCanvas(page, leaf, name, type, widget) {
    const out = { case: name };
    const before = await page.evaluate(pageState, { folder: FOLDER, panelWidget: PANEL_WIDGET });
    out.providers = before.providers;
    const target = await waitFor(page, "an empty place on the canvas", emptyCanvasPoint, null, 5000);
    out.target = target;
    out.drag = await drag(page, leaf, target);
    const after = await settle(page, (s) => added(before, s).length > 0, 5000);
    const made = added(before, after);
    out.added = made.map((n) => ({ type: n.type, widgets: n.widgets, ...(n.panel !== undefined ? { panel: n.panel } : {}) }));
    out.problems = [];
    if (made.length !== 1) out.problems.push(`${made.length} nodes added, not 1: ${JSON.stringify(out.added)}`);
    else if (made[0].type !== type) out.problems.push(`a ${made[0].type} was added, not a ${type}`);
    else if (made[0].widgets[widget] !== LORA) out.problems.push(`its ${widget} is ${made[0].widgets[widget]}, not ${LORA}`);
    await removeNodes(page, made.map((n) => n.id));
    return out;
}

/** (d) the exact-everywhere switch, on then off: what the server stores, and the /free requests it sends. */
async function everywhereSetting(page) {
    const out = { case: "everywhere_setting", problems: [] };
    const frees = [];
    const onRequest = (r) => {
        if (new URL(r.url()).pathname.endsWith("/free") && r.method() === "POST") frees.push(r.postData());
    };
    const stored = () =>
        page.evaluate(async (id) => (await window.comfyAPI.api.api.fetchApi(`/settings/${id}`)).json(), EVERYWHERE);
    page.on("request", onRequest);
    try {
        out.default = await page.evaluate((id) => window.comfyAPI.app.app.extensionManager.setting.get(id), EVERYWHERE);
        for (const value of [true, false]) {
            const before = frees.length;
            await page.evaluate(([id, v]) => window.comfyAPI.app.app.extensionManager.setting.set(id, v), [EVERYWHERE, value]);
            const deadline = Date.now() + within(5000);
            while (frees.length === before && Date.now() < deadline) await page.waitForTimeout(50);
            out[`stored_${value}`] = await stored();
            out[`frees_${value}`] = frees.length - before;
        }
    } finally {
        page.off("request", onRequest);
        await page
            .evaluate(([id]) => window.comfyAPI.app.app.extensionManager.setting.set(id, false), [EVERYWHERE])
            .catch(() => {});
    }
    out.free_bodies = frees;
    if (out.default !== false) out.problems.push(`its default is ${out.default}, not false`);
    for (const value of [true, false]) {
        if (out[`stored_${value}`] !== value) out.problems.push(`switched to ${value}, the server stores ${out[`stored_${value}`]}`);
        if (out[`frees_${value}`] !== 1) out.problems.push(`switched to ${value}: ${out[`frees_${value}`]} POST /free, not 1`);
    }
    return out;
}

async function checks({ page, result, workflow }) {
    await setRenderer(page);
    await setSetting(page, SETTING_DEFAULT); // a run stopped half-way may have left it set
    await loadWorkflow(page, workflow);
    await waitFor(
        page,
        "the loader and its panel (the Vue nodes laid out, in that renderer)",
        ([t, w, vue]) => {
            const node = window.comfyAPI.app.app.graph.nodes.find((n) => n.type === t);
            if (!node?.widgets?.some((x) => x.name === w)) return false;
            return !vue || !!document.querySelector(`.lg-node[data-node-id="${node.id}"]`);
        },
        [LOADER_TYPE, PANEL_WIDGET, result.renderer === "vue"],
        20000,
    );
    // Frontend 1.32.9 lists the example's missing checkpoint in a dialog over the graph (1.49.6 and 1.58.1 in a toast
    // or the node's badge): closed as a user would, and recorded.
    result.dialogs = await closeDialogs(page, 1500);
    const leaf = await openLibrary(page, result);
    // The canvas resizes beside the opened sidebar, and the nodes follow.
    await settled(page, "the canvas beside the opened library", graphLayout);
    const state = await page.evaluate(pageState, { folder: FOLDER, panelWidget: PANEL_WIDGET });
    state.frontend = result.frontend_version;
    result.providers = state.providers;
    result.vue_node_drop_target = state.vue_node_drop_target;
    result.cases = {};
    try {
        result.cases.onto_node = await ontoNode(page, leaf, state);
        mark("onto_node");
        result.cases.canvas_default = await ontoCanvas(page, leaf, "canvas_default", CORE_TYPE, CORE_WIDGET);
        mark("canvas_default");
        await setSetting(page, SETTING_OURS);
        await frames(page, 2);
        result.cases.canvas_lycoris = await ontoCanvas(page, leaf, "canvas_lycoris", LOADER_TYPE, NAME_WIDGET);
        mark("canvas_lycoris");
        result.cases.everywhere_setting = await everywhereSetting(page);
        mark("everywhere_setting");
    } finally {
        await setSetting(page, SETTING_DEFAULT).catch(() => {});
        // Close the library (its button toggles it), so the screenshots show the nodes.
        await page.locator(LIBRARY_BUTTON).first().click({ timeout: within(5000) }).catch(() => {});
        result.setting_after = await page
            .evaluate((id) => window.comfyAPI.app.app.extensionManager.setting.get(id), SETTING)
            .catch((e) => String(e));
    }
    const problems = Object.values(result.cases).flatMap((c) => (c.problems ?? []).map((p) => `${c.case}: ${p}`));
    check(problems.length === 0, problems.join("; "));
    check(result.setting_after === SETTING_DEFAULT, `${SETTING} was not set back: ${result.setting_after}`);
    result.ok = true;
}

/** In the page from its start: the native drag events it sees (what was dragged, where it was dropped), per drag. */
function recordDrags() {
    const seen = (window.__dropTestEvents = []);
    const describe = (e) => {
        const t = e.target;
        if (!(t instanceof Element)) return String(t?.nodeName);
        const id = t.closest("[data-testid]")?.getAttribute("data-testid");
        return `${t.tagName.toLowerCase()}${t.id ? "#" + t.id : ""}${id ? ` in ${id}` : ""}`;
    };
    for (const type of ["dragstart", "drop", "dragend"]) {
        window.addEventListener(type, (e) => seen.push({ type, target: describe(e), x: e.clientX, y: e.clientY }), true);
    }
}

runBrowserScript({
    name: "model_drop.mjs",
    initScript: `(${recordDrags})();`,
    workflowPath: WORKFLOW,
    nodeType: LOADER_TYPE,
    closeUp: { scale: 1.2, top: 120 },
    stateKey: "page_state",
    readState: (page) => page.evaluate(pageState, { folder: FOLDER, panelWidget: PANEL_WIDGET }),
    body: checks,
});
