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
// 2 = bad usage. The server must not have the loader's output cached (a fresh server, or --cache-none).

import { chromium } from "playwright-core";
import { mkdtempSync, readdirSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

// Node types that must be registered. Those in NEW_NODE_IDS only once a file in nodes/ defines them (until then a
// missing one is a warning, not a failure).
const NODE_IDS = ["LycorisLoader", "LycorisLoaderModelOnly", "LycorisInfo"];
const NEW_NODE_IDS = ["LycorisInfo"];
const LOADER_TYPE = "LycorisLoader";
const PANEL_WIDGET = "lycoris_panel";
const EXTENSION_NAME = "lycoris_nodes.panel";
const EXPECT_ALGORITHM = "LoKr";
const EXPECT_COVERAGE = "modules applied";
const CLOSE_UP_SCALE = 1.5; // canvas zoom for the node close-up screenshot

const HERE = dirname(fileURLToPath(import.meta.url));
const REPO = resolve(HERE, "..", "..");
const COMFY_URL = process.env.COMFY_URL;
const SCREENSHOT = process.env.SCREENSHOT;
const RENDERER = process.env.RENDERER || "classic";
const WORKFLOW = process.env.WORKFLOW || join(REPO, "example_workflows", "lycoris_loader.json");
const CHROMIUM = process.env.CHROMIUM || "/usr/bin/chromium";
const RUN_TIMEOUT = Number(process.env.TIMEOUT_MS || 180000);
const CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
];

/** Node ids that the pack's Python code in nodes/ mentions. */
function definedInRepo(ids) {
    const dir = join(REPO, "nodes");
    const code = readdirSync(dir)
        .filter((f) => f.endsWith(".py"))
        .map((f) => readFileSync(join(dir, f), "utf8"))
        .join("\n");
    return ids.filter((id) => code.includes(`"${id}"`));
}

const t0 = Date.now();
const timings = {};
const warnings = [];
const mark = (name) => (timings[name] = (Date.now() - t0) / 1000);
const log = (msg) => console.error(`panel.mjs: ${msg}`);

class CheckError extends Error {}
function check(cond, message) {
    if (!cond) throw new CheckError(message);
}

/** Poll fn (in the page) until it returns a truthy value; the last value is in the error on timeout. */
async function waitFor(page, what, fn, arg, timeout = 30000) {
    const deadline = Date.now() + timeout;
    let last;
    while (Date.now() < deadline) {
        last = await page.evaluate(fn, arg);
        if (last && (typeof last !== "object" || last.ok !== false)) return last;
        await page.waitForTimeout(100);
    }
    throw new CheckError(`timed out after ${timeout / 1000} s waiting for ${what}; last: ${JSON.stringify(last)}`);
}

async function closeTemplatesDialog(page, expected) {
    // For a new user (the server's Comfy.TutorialCompleted setting unset) the templates dialog opens a moment after
    // the app; Escape closes it.
    const dialog = page.locator(".p-dialog");
    try {
        await dialog.first().waitFor({ state: "visible", timeout: expected ? 20000 : 1000 });
    } catch {
        if (expected) warnings.push("the first-run templates dialog did not open");
        return false;
    }
    // Escape, as for any closable dialog; frontend 1.32.9 opens this one as a non-closable "layout" dialog that
    // ignores Escape, so then its own close button (×).
    await page.keyboard.press("Escape");
    try {
        await dialog.first().waitFor({ state: "hidden", timeout: 1000 });
        return "escape";
    } catch {
        // still open
    }
    const close = page.locator('.p-dialog button:has(i.pi-times), .p-dialog button[aria-label="Close"]').first();
    await close.click({ timeout: 5000 });
    try {
        await dialog.first().waitFor({ state: "hidden", timeout: 5000 });
        return "close button";
    } catch {
        // fall through
    }
    throw new CheckError("the first-run templates dialog closed neither on Escape nor with its close button");
}

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

async function main() {
    if (!["classic", "vue"].includes(RENDERER)) {
        console.error(`RENDERER must be classic or vue, not ${RENDERER}`);
        process.exit(2);
    }
    if (!COMFY_URL || !SCREENSHOT) {
        console.error("usage: COMFY_URL=http://127.0.0.1:PORT/ SCREENSHOT=out.png node tests/browser/panel.mjs");
        process.exit(2);
    }
    const workflow = JSON.parse(readFileSync(WORKFLOW, "utf8"));
    const original = workflow.nodes.find((n) => n.type === LOADER_TYPE)?.widgets_values;
    if (!original) {
        console.error(`${WORKFLOW} has no ${LOADER_TYPE} node`);
        process.exit(2);
    }
    const profile = mkdtempSync(join(tmpdir(), "lycoris-chromium-"));
    const pageErrors = [];
    const consoleErrors = [];
    let context;
    let page;
    const result = { ok: false, renderer: RENDERER, screenshot: SCREENSHOT };
    try {
        // A fresh --user-data-dir (playwright passes the profile folder as that flag).
        context = await chromium.launchPersistentContext(profile, {
            executablePath: CHROMIUM,
            headless: true,
            args: CHROMIUM_ARGS,
            viewport: { width: 1600, height: 1000 },
        });
        await context.grantPermissions(["clipboard-read", "clipboard-write"], { origin: new URL(COMFY_URL).origin });
        // The state reader, in every page before its scripts run.
        await context.addInitScript({
            content: `window.__lycorisPanelState = ${panelState}; window.__lycorisPanelOf = ${panelOf};`,
        });
        page = context.pages()[0] ?? (await context.newPage());
        page.on("pageerror", (err) => pageErrors.push(String(err?.stack || err)));
        page.on("console", (msg) => {
            if (msg.type() === "error") consoleErrors.push(msg.text());
        });

        const settings = await fetch(new URL("settings", COMFY_URL)).then((r) => r.json());
        const newUser = !settings["Comfy.TutorialCompleted"];
        await page.goto(COMFY_URL, { waitUntil: "domcontentloaded", timeout: 60000 });
        await waitFor(
            page,
            "the ComfyUI app and our extension",
            (name) => {
                const app = window.comfyAPI?.app?.app;
                if (!app?.graph || !window.LiteGraph) return false;
                return (app.extensions ?? []).some((e) => e.name === name);
            },
            EXTENSION_NAME,
            60000,
        );
        mark("app_loaded");
        result.templates_dialog_closed = await closeTemplatesDialog(page, newUser);

        const registered = await page.evaluate(
            (ids) => ids.filter((id) => id in window.LiteGraph.registered_node_types),
            NODE_IDS,
        );
        result.registered = registered;
        const inRepo = definedInRepo(NEW_NODE_IDS);
        for (const id of NODE_IDS) {
            if (registered.includes(id)) continue;
            if (NEW_NODE_IDS.includes(id) && !inRepo.includes(id)) {
                warnings.push(`${id} is not registered (nodes/ does not define it yet)`);
            } else {
                check(false, `node type ${id} is not registered; registered LyCORIS types: ${registered}`);
            }
        }

        // Settings are stored on the server: set the renderer both ways, a previous run may have switched it.
        await page.evaluate(
            (vue) => window.comfyAPI.app.app.extensionManager.setting.set("Comfy.VueNodes.Enabled", vue),
            RENDERER === "vue",
        );

        await page.evaluate((wf) => window.comfyAPI.app.app.loadGraphData(wf), workflow);
        mark("workflow_loaded");

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

        const others = registered.filter((id) => id !== LOADER_TYPE);
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

        // Queue the workflow and wait for the run to finish.
        const run = await page.evaluate(async ([timeout, loaderType]) => {
            const { app } = window.comfyAPI.app;
            const { api } = window.comfyAPI.api;
            const loader = app.graph.nodes.find((n) => n.type === loaderType);
            const done = new Promise((resolve) => {
                const timer = setTimeout(() => resolve({ status: "timeout" }), timeout);
                api.addEventListener("execution_cached", ({ detail }) => {
                    if (!detail?.nodes?.map(String).includes(String(loader.id))) return;
                    clearTimeout(timer);
                    resolve({
                        status: "cached",
                        detail: "the server had the loader's output cached from an earlier run with the same inputs, "
                            + "so it did not run and sent no report: use a fresh server or start it with --cache-none",
                    });
                });
                api.addEventListener("execution_success", () => {
                    clearTimeout(timer);
                    resolve({ status: "success" });
                });
                api.addEventListener("execution_error", ({ detail }) => {
                    clearTimeout(timer);
                    resolve({ status: "error", detail: `${detail?.node_type}: ${detail?.exception_message}` });
                });
            });
            await app.queuePrompt(0);
            return await done;
        }, [RUN_TIMEOUT, LOADER_TYPE]);
        check(run.status === "success", `the workflow run did not succeed: ${JSON.stringify(run)}`);
        mark("run_finished");

        const after = await waitFor(
            page,
            `the coverage line ("${EXPECT_COVERAGE}") and the chart`,
            ([type, cov]) => {
                const s = window.__lycorisPanelState(type);
                return s.ok && s.coverage.join(" ").includes(cov) && s.bars.length > 0 ? s : { ...s, ok: false };
            },
            [LOADER_TYPE, EXPECT_COVERAGE],
            15000,
        );
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
        await chip.click({ timeout: 5000 });
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
    } catch (err) {
        result.error = err instanceof CheckError ? err.message : String(err?.stack || err);
        if (page) {
            result.panel = await page.evaluate((t) => window.__lycorisPanelState?.(t), LOADER_TYPE).catch(() => null);
        }
    } finally {
        if (page) {
            try {
                await saveScreenshots(page, result);
            } catch (err) {
                result.ok = false;
                result.error = (result.error ? result.error + "; " : "") + `screenshot failed: ${err}`;
            }
        }
        if (context) await context.close().catch(() => {});
        rmSync(profile, { recursive: true, force: true });
    }
    mark("done");
    Object.assign(result, { warnings, timings, page_errors: pageErrors.slice(0, 10) });
    for (const w of warnings) log(`warning: ${w}`);
    if (!result.ok) log(`FAILED (${RENDERER}): ${result.error}`);
    console.log(JSON.stringify(result));
    process.exit(result.ok ? 0 : 1);
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
        await page.evaluate((nodeId) => {
            const graph = window.comfyAPI.app.app.graph;
            graph.remove(graph.getNodeById(nodeId));
        }, id);
        out[type] = { metadata: true, route_error: refused.errors[0], problems_listed: warned.problems.length };
    }
    check(pageErrors.length === errorsBefore, `page errors on the other nodes: ${pageErrors.slice(errorsBefore)}`);
    return out;
}

async function saveScreenshots(page, result) {
    await page.mouse.move(1590, 990); // no hover tooltips in the pictures
    await page.waitForTimeout(300);
    await page.screenshot({ path: SCREENSHOT });
    // A close-up of the loader node: zoom the canvas onto it, then clip to its Vue element or its box on the canvas.
    const zoomed = await page.evaluate(
        ([type, scale]) => {
            const app = window.comfyAPI.app.app;
            const node = app.graph?.nodes.find((n) => n.type === type);
            if (!node || !app.canvas?.ds) return false;
            const ds = app.canvas.ds;
            ds.scale = scale;
            ds.offset[0] = 120 / scale - node.pos[0];
            ds.offset[1] = 120 / scale - (node.pos[1] - window.LiteGraph.NODE_TITLE_HEIGHT);
            app.canvas.setDirty(true, true);
            return true;
        },
        [LOADER_TYPE, CLOSE_UP_SCALE],
    );
    if (zoomed) await page.waitForTimeout(500); // redraw, DOM widgets and Vue nodes follow the canvas
    const box = await page.evaluate((type) => {
        const app = window.comfyAPI.app.app;
        const node = app.graph?.nodes.find((n) => n.type === type);
        if (!node) return null;
        const vueEl = document.querySelector(`.lg-node[data-node-id="${node.id}"]`);
        if (vueEl && vueEl.offsetParent !== null) {
            const r = vueEl.getBoundingClientRect();
            return { x: r.x, y: r.y, width: r.width, height: r.height };
        }
        const canvas = app.canvas;
        const title = window.LiteGraph.NODE_TITLE_HEIGHT;
        const [x, y] = canvas.ds.convertOffsetToCanvas([node.pos[0], node.pos[1] - title]);
        const r = canvas.canvas.getBoundingClientRect();
        const s = canvas.ds.scale;
        return { x: r.x + x, y: r.y + y, width: node.size[0] * s, height: (node.size[1] + title) * s };
    }, LOADER_TYPE);
    if (box) {
        const pad = 12;
        const clip = {
            x: Math.max(0, box.x - pad),
            y: Math.max(0, box.y - pad),
            width: Math.min(1600, box.width + 2 * pad),
            height: Math.min(1000, box.height + 2 * pad),
        };
        const path = SCREENSHOT.replace(/(\.png)?$/i, "-node.png");
        await page.screenshot({ path, clip });
        result.node_screenshot = path;
    }
}

main();
