// What the browser scripts (panel.mjs, block_weights.mjs) share: the env they read, the checks and the polling, the
// browser with a fresh profile, opening the UI (and closing the dialogs the frontend opens for a new user), the
// renderer, loading a workflow, queueing it, the screenshots and the JSON result line.
//
// Env: COMFY_URL, SCREENSHOT (both required), RENDERER=classic|vue (default classic), CHROMIUM (default
// /usr/bin/chromium), TIMEOUT_MS for one workflow run (default 180000), BROWSER_SLOWDOWN (default: from the load).
//
// Waiting: the scripts wait for conditions (the graph on the canvas, a dialog hidden, rectangles unchanged over
// rendered frames), never for a fixed time that a busy machine can outlast. Every deadline goes through within(),
// which stretches it by how busy the machine is when the wait starts, so a deadline only decides how long a real
// failure takes to be reported, never whether a slow pass passes (issue #38).

import { chromium, errors } from "playwright-core";
import { mkdtempSync, readFileSync, rmSync } from "node:fs";
import { cpus, loadavg, tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

export const REPO = resolve(dirname(fileURLToPath(import.meta.url)), "..", "..");
export const COMFY_URL = process.env.COMFY_URL;
export const SCREENSHOT = process.env.SCREENSHOT;
export const RENDERER = process.env.RENDERER || "classic";
export const CHROMIUM = process.env.CHROMIUM || "/usr/bin/chromium";
export const EXTENSION_NAME = "lycoris_nodes.panel";
const VIEWPORT = { width: 1600, height: 1000 };
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

// What the pack causes in the page, told from what the frontend does on its own (1.58.1 alone logs a dozen
// deprecation warnings and 404s of its own on start-up): console warnings and errors written while one of the pack's
// files is on the call stack (V8 keeps the awaited callers in it), requests from its code that failed or were
// answered 4xx/5xx, and failed requests for the pack's own URLs (its web folder, docs, templates, routes).
const PACK_FILE = /\/extensions\/lycoris[^/]*\//i;
const PACK_URL = /\/extensions\/lycoris|\/lycoris\/|\/workflow_templates\/lycoris/i;
const PACK_WATCH = `(() => {
    const ours = ${PACK_FILE};
    const report = (kind, text) => window.__packReport?.({ kind, text: String(text).slice(0, 500) });
    const fromPack = () => ours.test((new Error().stack ?? "").split("\\n").slice(2).join("\\n"));
    for (const level of ["warn", "error"]) {
        const original = console[level];
        console[level] = function (...args) {
            if (fromPack()) report("console." + level, args.map(String).join(" "));
            return original.apply(this, args);
        };
    }
    const fetch0 = window.fetch;
    window.fetch = async function (...args) {
        const mine = fromPack();
        try {
            const resp = await fetch0.apply(this, args);
            if (mine && !resp.ok) report("fetch", resp.status + " " + resp.url);
            return resp;
        } catch (e) {
            if (mine) report("fetch", e + " " + args[0]);
            throw e;
        }
    };
})();`;

/**
 * How many times slower than a quiet machine this one is likely to be now: twice the 1-minute load average per core
 * (a run beside two busy processes on two cores reads about 2 x 4 / 2 = 4), at least 1 and at most 8; or
 * BROWSER_SLOWDOWN. Read when each wait starts: the load average follows a new load within a minute or so.
 */
export function slowdown() {
    const forced = Number(process.env.BROWSER_SLOWDOWN);
    if (forced > 0) return forced;
    return Math.min(8, Math.max(1, (2 * loadavg()[0]) / Math.max(1, cpus().length)));
}

/** A deadline of `ms` on a quiet machine, stretched by slowdown(). */
export const within = (ms) => Math.round(ms * slowdown());

/** The default for one workflow run (a server step is CPU work too). */
export const RUN_TIMEOUT = Number(process.env.TIMEOUT_MS || 180000);

const t0 = Date.now();
const timings = {};
export const warnings = [];
export const mark = (name) => (timings[name] = (Date.now() - t0) / 1000);

export class CheckError extends Error {}
export function check(cond, message) {
    if (!cond) throw new CheckError(message);
}

/**
 * Poll fn (in the page) until it returns a truthy value that is not {ok: false}; the last value is in the error.
 * `timeout` is the quiet machine's deadline, stretched by within().
 */
export async function waitFor(page, what, fn, arg, timeout = 30000) {
    const limit = within(timeout);
    const deadline = Date.now() + limit;
    let last;
    while (Date.now() < deadline) {
        last = await page.evaluate(fn, arg);
        if (last && (typeof last !== "object" || last.ok !== false)) return last;
        await page.waitForTimeout(100);
    }
    throw new CheckError(`timed out after ${limit / 1000} s waiting for ${what}; last: ${JSON.stringify(last)}`);
}

/** Resolve after the page has rendered `n` more frames (on a busy machine frames come late, and so does this). */
export async function frames(page, n = 2) {
    await page.evaluate((count) => new Promise((resolve) => {
        let left = count;
        const step = () => (--left <= 0 ? resolve() : requestAnimationFrame(step));
        requestAnimationFrame(step);
    }), n);
}

/**
 * Read fn (in the page) until it gives the same value over `frameCount` rendered frames and at least `quietMs`:
 * layout that follows the canvas or a report (Vue nodes, DOM widgets, a grown node) counts as settled then. Returns
 * the value; a value still changing at the deadline (within(timeout)) fails the check, naming `what`.
 */
export async function settled(page, what, fn, arg, { quietMs = 400, frameCount = 3, timeout = 20000 } = {}) {
    const limit = within(timeout);
    const deadline = Date.now() + limit;
    let last = null;
    let since = Date.now();
    let stable = 0;
    while (Date.now() < deadline) {
        await frames(page, 1);
        const now = await page.evaluate(fn, arg);
        if (last !== null && JSON.stringify(now) === JSON.stringify(last)) stable += 1;
        else {
            stable = 0;
            since = Date.now();
        }
        last = now;
        if (stable >= frameCount && Date.now() - since >= quietMs) return now;
        await page.waitForTimeout(50);
    }
    throw new CheckError(`${what} kept changing for ${limit / 1000} s; last: ${JSON.stringify(last).slice(0, 400)}`);
}

/**
 * The canvas element's size, its view (offset, scale), and every node's position and size with its Vue element's box
 * when it has one: what settled() watches after a run, a pan or a sidebar opening.
 */
export function graphLayout() {
    const { canvas, graph } = window.comfyAPI.app.app;
    const box = (el) => {
        const r = el.getBoundingClientRect();
        return [r.x, r.y, r.width, r.height].map(Math.round);
    };
    const nodes = graph.nodes.map((n) => {
        const el = document.querySelector(`.lg-node[data-node-id="${n.id}"]`);
        return [n.id, ...[...n.pos, ...n.size].map(Math.round), ...(el && el.offsetParent !== null ? box(el) : [])];
    });
    return { canvas: box(canvas.canvas), view: [...canvas.ds.offset, canvas.ds.scale], nodes };
}

/** A Playwright error's first line and the call log's last lines (what the element was waiting for), for a report. */
export function describeError(err) {
    const lines = String(err?.message ?? err).split("\n").map((l) => l.trim()).filter(Boolean);
    return [lines[0], ...lines.slice(1).filter((l) => !/^=+/.test(l)).slice(-3)].join(" | ").slice(0, 600);
}

// A dialog of either frontend: PrimeVue's .p-dialog (frontend 1.32, ComfyUI 0.3.75) and reka-ui's dialog (1.49,
// ComfyUI 0.33) both carry role="dialog"; their close buttons show the pi-times icon (1.49's also has an aria-label).
const DIALOG = '[role="dialog"]';
const CLOSE_BUTTON = 'button[aria-label="Close dialog"], button:has(i.pi-times)';
const MAX_FIRST_RUN_DIALOGS = 3; // more than this open at start-up is a change in the frontend worth failing on

async function isTimeout(promise) {
    try {
        await promise;
        return false;
    } catch (err) {
        if (err instanceof errors.TimeoutError) return true;
        throw err;
    }
}

/** Close one open dialog: Escape, as a user would, else its own close button; fail when it stays open. */
async function closeDialog(page, dialog) {
    // 1.58.1 opens the templates dialog without a title (its aria-labelledby is a generated id) and names it with
    // data-dialog-key; 1.32.9 and 1.49.6 label it with aria-labelledby.
    const label = (await dialog.getAttribute("data-dialog-key")) || (await dialog.getAttribute("aria-labelledby"))
        || "(unlabelled)";
    const handle = await dialog.elementHandle();
    await page.keyboard.press("Escape");
    if (!(await isTimeout(handle.waitForElementState("hidden", { timeout: within(2000) })))) {
        return { dialog: label, closed_by: "escape" };
    }
    // Frontend 1.32.9 opens the templates dialog as a non-closable "layout" dialog that ignores Escape.
    await dialog.locator(CLOSE_BUTTON).first().click({ timeout: within(5000) });
    if (await isTimeout(handle.waitForElementState("hidden", { timeout: within(5000) }))) {
        throw new CheckError(`the dialog ${label} closed neither on Escape nor with its close button`);
    }
    return { dialog: label, closed_by: "close button" };
}

/**
 * Close the dialogs the frontend opens for a new user (firstRun: the server's Comfy.TutorialCompleted unset) and
 * return what was closed how. Both frontends first store Comfy.TutorialCompleted = true, then open the templates
 * dialog (1.32.9 after loading a blank workflow, 1.49.6 right away, about a second after the app is up), so: wait for
 * the setting, then for the dialog, close every open dialog, and check none is left.
 */
export async function closeFirstRunDialogs(page, firstRun) {
    const open = page.locator(`${DIALOG}:visible`);
    const closed = [];
    if (firstRun) {
        await waitFor(
            page,
            "the frontend to store Comfy.TutorialCompleted (its first-run start-up)",
            () => window.comfyAPI.app.app.extensionManager.setting.get("Comfy.TutorialCompleted") === true,
            null,
            30000,
        );
        const wait = within(10000);
        if (await isTimeout(open.first().waitFor({ state: "visible", timeout: wait }))) {
            warnings.push(`no dialog opened within ${wait / 1000} s of the frontend's first-run start-up`);
        }
        while ((await open.count()) > 0) {
            check(closed.length < MAX_FIRST_RUN_DIALOGS, `dialogs keep opening: ${JSON.stringify(closed)}`);
            closed.push(await closeDialog(page, open.first()));
        }
    }
    const describe = (els) => els.map((e) => e.getAttribute("aria-labelledby") || e.outerHTML.slice(0, 200));
    const left = await open.evaluateAll(describe);
    check(left.length === 0, `dialogs open over the graph: ${JSON.stringify(left)}`);
    return closed;
}

/**
 * Close every dialog over the graph (Escape, else its close button), first waiting up to `wait` ms (stretched by
 * within()) for one to open; return their titles. For dialogs the frontend opens over a loaded workflow (a
 * missing-model list), and for one left over a retried step.
 */
export async function closeDialogs(page, wait = 0) {
    const open = page.locator('[role="dialog"]:visible');
    if (wait && (await isTimeout(open.first().waitFor({ state: "visible", timeout: within(wait) })))) return [];
    const closed = [];
    for (let i = 0; i < 4 && (await open.count()) > 0; i++) {
        const dialog = open.first();
        const handle = await dialog.elementHandle().catch(() => null);
        if (!handle) continue; // it closed by itself between the count and now
        closed.push(((await dialog.innerText().catch(() => "")) || "").split("\n")[0].slice(0, 80));
        await page.keyboard.press("Escape");
        if (await isTimeout(handle.waitForElementState("hidden", { timeout: within(2000) }))) {
            await dialog.locator(CLOSE_BUTTON).first().click({ timeout: within(3000) });
            await isTimeout(handle.waitForElementState("hidden", { timeout: within(3000) })); // checked below
        }
    }
    check((await open.count()) === 0, `a dialog stays open over the graph: ${closed}`);
    return closed;
}

/**
 * Load the UI, wait for the app, our extension and the start-up workflow, close the first-run dialogs. In result:
 * first_run (the server's Comfy.TutorialCompleted was unset), first_run_dialogs (closeFirstRunDialogs),
 * frontend_version.
 */
async function openUI(page, result) {
    const settings = await fetch(new URL("settings", COMFY_URL)).then((r) => r.json());
    result.first_run = !settings["Comfy.TutorialCompleted"];
    await page.goto(COMFY_URL, { waitUntil: "domcontentloaded", timeout: within(60000) });
    await waitForApp(page);
    mark("app_loaded");
    result.frontend_version = await page.evaluate(() => window.__COMFYUI_FRONTEND_VERSION__);
    result.first_run_dialogs = await closeFirstRunDialogs(page, result.first_run);
    mark("first_run_dialogs_closed");
}

/** Reload the page, as a user coming back to ComfyUI: the frontend restores the open workflow. */
export async function reopenUI(page) {
    await page.reload({ waitUntil: "domcontentloaded", timeout: within(60000) });
    await waitForApp(page);
    mark("reopened");
}

async function waitForApp(page) {
    await waitFor(
        page,
        "the ComfyUI app, our extension and the start-up workflow",
        (name) => {
            const app = window.comfyAPI?.app?.app;
            // app.extensions reads a store that 1.49.6 sets up only with the Vue app: it throws before vueAppReady.
            if (!app?.vueAppReady || !window.LiteGraph || !app.graph || !app.canvas) return false;
            if (!(app.extensions ?? []).some((e) => e.name === name)) return false;
            // The graph and canvas exist before the node types are registered (1.49.6: seconds before), and the
            // start-up workflow (the default one, or a blank one for a new user) is loaded after that: a workflow
            // loaded earlier finds no node types or is replaced. The active workflow is set once it is in.
            return !!app.extensionManager?.workflow?.activeWorkflow;
        },
        EXTENSION_NAME,
        60000,
    );
}

/** Settings are stored on the server: set the renderer both ways, a previous run may have switched it. */
export async function setRenderer(page) {
    await page.evaluate(
        (vue) => window.comfyAPI.app.app.extensionManager.setting.set("Comfy.VueNodes.Enabled", vue),
        RENDERER === "vue",
    );
}

export async function loadWorkflow(page, workflow) {
    await page.evaluate((wf) => window.comfyAPI.app.app.loadGraphData(wf), workflow);
    mark("workflow_loaded");
}

/**
 * Queue the workflow and wait for the run to finish; a failed run fails the check. With cachedType, a run in which
 * the server answers that node's output from its cache fails too (it sent no report); with expectCached, a run in
 * which it does NOT is the failure (the node ran again).
 */
export async function queueAndWait(page, cachedType = null, expectCached = false) {
    const run = await page.evaluate(async ([timeout, loaderType, wantCached]) => {
        const { app } = window.comfyAPI.app;
        const { api } = window.comfyAPI.api;
        const loader = loaderType && app.graph.nodes.find((n) => n.type === loaderType);
        const done = new Promise((resolve) => {
            const timer = setTimeout(() => resolve({ status: "timeout" }), timeout);
            if (loader) {
                api.addEventListener("execution_cached", ({ detail }) => {
                    const cached = !!detail?.nodes?.map(String).includes(String(loader.id));
                    if (wantCached) {
                        if (!cached) {
                            clearTimeout(timer);
                            resolve({ status: "ran", detail: `${loaderType} was not answered from the cache` });
                        }
                        return;
                    }
                    if (!cached) return;
                    clearTimeout(timer);
                    resolve({
                        status: "cached",
                        detail: "the server had the loader's output cached from an earlier run with the same inputs, "
                            + "so it did not run and sent no report: use a fresh server, start it with --cache-none, "
                            + "or POST /free {\"free_memory\": true} before the script",
                    });
                });
            }
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
    }, [within(RUN_TIMEOUT), cachedType, expectCached]);
    check(run.status === "success", `the workflow run did not succeed: ${JSON.stringify(run)}`);
}

/** Every node's rectangle in screen pixels, as the renderer draws it, and the intersecting pairs. */
export function nodeRects() {
    const app = window.comfyAPI.app.app;
    const canvas = app.canvas;
    const title = window.LiteGraph.NODE_TITLE_HEIGHT;
    const rects = [];
    for (const node of app.graph.nodes) {
        const vue = document.querySelector(`.lg-node[data-node-id="${node.id}"]`);
        let box;
        if (vue && vue.offsetParent !== null) {
            const r = vue.getBoundingClientRect();
            box = [r.left, r.top, r.right, r.bottom];
        } else {
            const [x, y] = canvas.ds.convertOffsetToCanvas([node.pos[0], node.pos[1] - title]);
            const s = canvas.ds.scale;
            const h = node.flags?.collapsed ? title : node.size[1] + title;
            box = [x, y, x + node.size[0] * s, y + h * s];
        }
        rects.push({ id: node.id, type: node.type, title: node.title, box: box.map((v) => Math.round(v * 10) / 10) });
    }
    const overlaps = [];
    for (let i = 0; i < rects.length; i++) {
        for (let j = i + 1; j < rects.length; j++) {
            const [a, b] = [rects[i].box, rects[j].box];
            const w = Math.min(a[2], b[2]) - Math.max(a[0], b[0]);
            const h = Math.min(a[3], b[3]) - Math.max(a[1], b[1]);
            if (w > 0.5 && h > 0.5) overlaps.push({ a: rects[i].title, b: rects[j].title, w: Math.round(w), h: Math.round(h) });
        }
    }
    return { rects, overlaps, scale: canvas.ds.scale };
}

/** The first node of `type`: its Vue element's box, or its canvas box (title bar and body), in page pixels. */
export function nodeBox(type) {
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
}

/**
 * SCREENSHOT, then a close-up of the first node of nodeType ("<name>-node.png", in result.node_screenshot): zoom the
 * canvas onto it (scale, its title `top` px below the page's top), then clip to its Vue element or its canvas box.
 */
async function saveScreenshots(page, result, { nodeType, scale, top }) {
    await page.mouse.move(VIEWPORT.width - 10, VIEWPORT.height - 10); // no hover tooltips in the pictures
    await frames(page, 3);
    await page.screenshot({ path: SCREENSHOT });
    const zoomed = await page.evaluate(
        ([type, s, y]) => {
            const app = window.comfyAPI.app.app;
            const node = app.graph?.nodes.find((n) => n.type === type);
            if (!node || !app.canvas?.ds) return false;
            const ds = app.canvas.ds;
            ds.scale = s;
            ds.offset[0] = 120 / s - node.pos[0];
            ds.offset[1] = y / s - (node.pos[1] - window.LiteGraph.NODE_TITLE_HEIGHT);
            app.canvas.setDirty(true, true);
            return true;
        },
        [nodeType, scale, top],
    );
    // Redraw; the DOM widgets and Vue nodes follow the canvas a frame or more later.
    if (zoomed) await settled(page, `the ${nodeType} node's box after zooming onto it`, nodeBox, nodeType);
    const box = await page.evaluate(nodeBox, nodeType);
    if (box) {
        const pad = 12;
        const x = Math.max(0, box.x - pad);
        const y = Math.max(0, box.y - pad);
        const clip = {
            x,
            y,
            width: Math.min(VIEWPORT.width - x, box.width + 2 * pad),
            height: Math.min(VIEWPORT.height - y, box.height + 2 * pad),
        };
        const path = SCREENSHOT.replace(/(\.png)?$/i, "-node.png");
        await page.screenshot({ path, clip });
        result.node_screenshot = path;
    }
}

/**
 * The frame of a browser script: check the env (exit 2 on bad usage), launch Chromium with a fresh profile, open the
 * UI, run `body`, save the screenshots, print the JSON result line; exit 0 when body finished, 1 when it threw.
 *
 * name: the script's file name, for messages. workflowPath: the workflow to test, which must have a node of nodeType
 * (exit 2 otherwise). nodeType, closeUp ({scale, top}): the node of the close-up.
 * initScript: JS run in every page before its own scripts. clipboard: grant clipboard access to the ComfyUI origin.
 * stateKey, readState(page): on a failure, result[stateKey] = await readState(page).
 * onPage(page): called with the page before the UI is opened (to listen to its requests from the start).
 * body({page, result, workflow, original, pageErrors, consoleErrors}): the checks, with the workflow and its nodeType
 * node's widgets_values; sets result.ok = true when they all pass.
 */
export async function runBrowserScript({
    name, workflowPath, nodeType, closeUp, initScript, clipboard = false, stateKey, readState, onPage, body,
}) {
    const log = (msg) => console.error(`${name}: ${msg}`);
    if (!["classic", "vue"].includes(RENDERER)) {
        log(`RENDERER must be classic or vue, not ${RENDERER}`);
        process.exit(2);
    }
    if (!COMFY_URL || !SCREENSHOT) {
        log(`usage: COMFY_URL=http://127.0.0.1:PORT/ SCREENSHOT=out.png [RENDERER=classic|vue] node tests/browser/${name}`);
        process.exit(2);
    }
    const workflow = JSON.parse(readFileSync(workflowPath, "utf8"));
    const original = workflow.nodes.find((n) => n.type === nodeType)?.widgets_values;
    if (!original) {
        log(`${workflowPath} has no ${nodeType} node`);
        process.exit(2);
    }
    const profile = mkdtempSync(join(tmpdir(), "lycoris-chromium-"));
    const pageErrors = [];
    const consoleErrors = [];
    const consoleLog = []; // every console warning and error: {type, text, url}
    const failedRequests = []; // every request that failed or was answered 4xx/5xx: {url, status}
    const packIssues = []; // what of those the pack caused (PACK_WATCH): any fails the script
    const result = { ok: false, renderer: RENDERER, screenshot: SCREENSHOT };
    let context;
    let page;
    try {
        // A fresh --user-data-dir (playwright passes the profile folder as that flag).
        context = await chromium.launchPersistentContext(profile, {
            executablePath: CHROMIUM,
            headless: true,
            args: CHROMIUM_ARGS,
            viewport: VIEWPORT,
        });
        if (clipboard) {
            await context.grantPermissions(["clipboard-read", "clipboard-write"], { origin: new URL(COMFY_URL).origin });
        }
        await context.exposeBinding("__packReport", (_source, entry) => packIssues.push(entry));
        await context.addInitScript({ content: PACK_WATCH });
        if (initScript) await context.addInitScript({ content: initScript });
        page = context.pages()[0] ?? (await context.newPage());
        page.on("pageerror", (err) => pageErrors.push(String(err?.stack || err)));
        page.on("console", (msg) => {
            if (msg.type() === "error") consoleErrors.push(msg.text());
            if (["error", "warning"].includes(msg.type())) {
                consoleLog.push({ type: msg.type(), text: msg.text().slice(0, 500), url: msg.location()?.url ?? "" });
            }
        });
        page.on("requestfailed", (req) => {
            const why = req.failure()?.errorText ?? "";
            if (/ERR_ABORTED/.test(why)) return; // a navigation or reload cancelled it
            failedRequests.push({ url: req.url(), status: why });
            if (PACK_URL.test(req.url())) packIssues.push({ kind: "request", text: `${why} ${req.url()}` });
        });
        page.on("response", (resp) => {
            if (resp.status() >= 400) failedRequests.push({ url: resp.url(), status: resp.status() });
            if (resp.status() >= 400 && PACK_URL.test(resp.url())) {
                packIssues.push({ kind: "request", text: `${resp.status()} ${resp.url()}` });
            }
        });
        onPage?.(page);
        await openUI(page, result);
        await body({ page, result, workflow, original, pageErrors, consoleErrors });
    } catch (err) {
        result.error = err instanceof CheckError ? err.message : String(err?.stack || err);
        if (page && readState) result[stateKey] = await readState(page).catch(() => null);
    } finally {
        if (page) {
            try {
                await saveScreenshots(page, result, { nodeType, ...closeUp });
            } catch (err) {
                result.ok = false;
                result.error = (result.error ? result.error + "; " : "") + `screenshot failed: ${err}`;
            }
        }
        if (context) await context.close().catch(() => {});
        rmSync(profile, { recursive: true, force: true });
    }
    mark("done");
    const packPageErrors = pageErrors.filter((e) => PACK_FILE.test(e)).map((text) => ({ kind: "pageerror", text }));
    const caused = [...packIssues, ...packPageErrors];
    if (caused.length && result.ok) {
        result.ok = false;
        result.error = `the pack caused ${caused.length} console warning(s)/error(s) or failed request(s): `
            + JSON.stringify(caused.slice(0, 5));
    }
    Object.assign(result, {
        warnings, timings, page_errors: pageErrors.slice(0, 10), console: consoleLog.slice(0, 50),
        failed_requests: failedRequests.slice(0, 50), pack_issues: caused.slice(0, 20),
    });
    for (const w of warnings) log(`warning: ${w}`);
    if (!result.ok) log(`FAILED (${RENDERER}): ${result.error}`);
    console.log(JSON.stringify(result));
    process.exit(result.ok ? 0 : 1);
}

