// A new user's tour of the pack in a real browser against a real ComfyUI server (tests/e2e/test_browser_tour.py).
//
//   COMFY_URL=http://127.0.0.1:8188/ SCREENSHOT=/tmp/tour.png RENDERER=classic STRENGTH=0.9 node tests/browser/tour.mjs
//
// Env (besides common.mjs's): STRENGTH, the loader's strength_model for the panel's runs (default 0.9): a value no
// other run on the server used, so the first run really executes the loader; DEMO, JSON {files: {standard name: demo
// file}, size, steps}: how the example is run on the tiny model (scripts/example_models.py's for_demo, done here as a
// user would: picking the files in the combos, setting the latent size and the steps).
//
// 1. The template browser: the pack's examples (example_workflows/*.json) are listed under the pack's own category,
//    and every card shows the pack's thumbnail (loaded, naturalWidth > 0; not the frontend's placeholder).
// 2. Each example, opened from its card as a user would: its nodes are all in the graph and on screen; dialogs the
//    frontend opens over it (a missing-model list) are recorded and closed.
// 3. The LyCORIS Loader panel in its three states, on the loader example: fresh (the file's metadata, "run the
//    workflow to see what it changed"), after a run (the coverage line), and after the page is reopened and the same
//    prompt queued again, which ComfyUI answers from its cache without running the loader (the same coverage line).
// 4. Hygiene: no request for the pack's files (templates, thumbnails, web/ files, docs) answered 404 or 5xx during
//    all of it; nothing of ours added to document.head/body or window; every id and class in the panels is
//    "lycoris-...".
// Prints one JSON line; exit 0 = all checks passed, 1 = a check failed, 2 = bad usage.

import { readdirSync, readFileSync } from "node:fs";
import { join } from "node:path";

import {
    CheckError, REPO, check, closeDialogs, describeError, frames, mark, queueAndWait, reopenUI, runBrowserScript,
    setRenderer, settled, waitFor, warnings, within,
} from "./common.mjs";

const EXAMPLES = join(REPO, "example_workflows");
const LOADER_EXAMPLE = "lycoris_loader";
const LOADER_TYPE = "LycorisLoader";
const STRENGTH = Number(process.env.STRENGTH || 0.9);
const DEMO = JSON.parse(process.env.DEMO || "null") ?? {
    files: {
        "v1-5-pruned-emaonly-fp16.safetensors": "tiny_sd15.safetensors",
        "your_lycoris_file.safetensors": "demo_lokr_dora.safetensors",
    },
    size: 64,
    steps: 4,
};
const IDLE = "run the workflow to see what it changed";
const COVERAGE = "modules applied";
const CARD = (name) => `[data-testid="template-workflow-${name}"]`;
// The pack's files the frontend asks for: its templates and thumbnails, its web/ folder, its node docs.
const OURS = /\/workflow_templates|\/extensions\/lycoris|Lycoris\w*\.md/i;

const names = readdirSync(EXAMPLES).filter((f) => f.endsWith(".json")).map((f) => f.slice(0, -5)).sort();

/** The loader's panel, in the page. */
function loaderPanel(type) {
    const node = window.comfyAPI.app.app.graph.nodes.find((n) => n.type === type);
    const root = node?.widgets?.find((w) => w.name === "lycoris_panel")?.element;
    if (!root) return { ok: false, reason: `no ${type} node with a panel` };
    const q = (sel) => [...root.querySelectorAll(sel)].map((e) => e.textContent);
    return {
        ok: true,
        text: root.innerText,
        algos: q(".lycoris-algos"),
        coverage: q(".lycoris-coverage"),
        lines: q(".lycoris-coverage .lycoris-line"),
        cached: q(".lycoris-cached"),
        bars: root.querySelectorAll(".lycoris-chart .lycoris-bar").length,
        errors: q(".lycoris-error"),
    };
}

/** Open the template browser on the pack's category and wait for its cards' images to settle. */
async function openTemplates(page, category) {
    // The dialog's key names it (the first-run templates dialog is the same one, see common.mjs): 1.32.9 and 1.49.6
    // label it with the key (aria-labelledby); 1.58.1 opens it headless, with no label, and marks it with
    // data-dialog-key instead (GlobalDialog.vue). Whichever the page has.
    const key = "global-workflow-template-selector";
    const dialog = page.locator(
        `[role="dialog"][aria-labelledby="${key}"]:visible, [role="dialog"][data-dialog-key="${key}"]:visible`,
    );
    // The command toggles the browser. Right after the first-run templates dialog was closed (1.49.6) a call can find
    // it still counted as open, and on a loaded machine the category can be re-rendered under the click: so every
    // dialog is closed and the browser opened again, at most 3 times; each retry's reason is kept in the warnings.
    const failures = [];
    for (let attempt = 1; attempt <= 3; attempt++) {
        await page.evaluate(() => window.comfyAPI.app.app.extensionManager.command.execute("Comfy.BrowseTemplates"));
        try {
            await dialog.first().waitFor({ state: "visible", timeout: within(10000) });
        } catch (err) {
            failures.push(`attempt ${attempt}: it did not open: ${describeError(err)}`);
            await closeDialogs(page);
            continue;
        }
        try {
            await dialog.first().getByText(category, { exact: true }).first().click({ timeout: within(15000) });
            await page.locator(CARD(names[0])).first().waitFor({ state: "visible", timeout: within(20000) });
            if (attempt > 1) warnings.push(`the template browser opened on attempt ${attempt}: ${failures.join("; ")}`);
            return dialog.first();
        } catch (err) {
            failures.push(`attempt ${attempt}: its ${category} category did not show the cards: ${describeError(err)}`);
            await closeDialogs(page);
        }
    }
    throw new CheckError(`the template browser (Comfy.BrowseTemplates, 3 tries): ${failures.join("; ")}`);
}

async function thumbnails(page) {
    // Ten cards do not fit the dialog, and the frontend loads a card's picture only while it is in view (and may drop
    // it again once scrolled away): visit each card as a user scrolling would, and check its picture there.
    const out = {};
    for (const name of names) {
        await page.locator(`[data-testid="template-workflow-${name}"]`).first().scrollIntoViewIfNeeded();
        out[name] = await waitFor(
            page,
            `the ${name} card's thumbnail to finish loading`,
            (card) => {
                const img = document.querySelector(`[data-testid="template-workflow-${card}"]`)?.querySelector("img");
                if (!img || !img.complete) return { ok: false, waiting: card };
                return { src: img.currentSrc || img.src, naturalWidth: img.naturalWidth };
            },
            name,
            30000,
        );
    }
    return out;
}

/** The graph's node types (sorted) and the nodes not wholly inside the canvas's visible area. */
function graphView() {
    const app = window.comfyAPI.app.app;
    const canvas = app.canvas;
    const rect = canvas.canvas.getBoundingClientRect();
    const title = window.LiteGraph.NODE_TITLE_HEIGHT;
    const off = [];
    for (const node of app.graph.nodes) {
        const vue = document.querySelector(`.lg-node[data-node-id="${node.id}"]`);
        let box;
        if (vue && vue.offsetParent !== null) {
            const r = vue.getBoundingClientRect();
            box = [r.left - rect.left, r.top - rect.top, r.right - rect.left, r.bottom - rect.top];
        } else {
            const [x, y] = canvas.ds.convertOffsetToCanvas([node.pos[0], node.pos[1] - title]);
            const s = canvas.ds.scale;
            box = [x, y, x + node.size[0] * s, y + (node.size[1] + title) * s];
        }
        if (box[0] < -1 || box[1] < -1 || box[2] > rect.width + 1 || box[3] > rect.height + 1) {
            off.push({ id: node.id, type: node.type, box: box.map(Math.round), canvas: [rect.width, rect.height] });
        }
    }
    return { types: app.graph.nodes.map((n) => n.type).sort(), off };
}

/** The example on the tiny model (scripts/example_models.py for_demo), set in the widgets as a user would. */
function runOnDemo({ files, size, steps }) {
    const done = [];
    const set = (node, name, value) => {
        const w = node.widgets?.find((x) => x.name === name);
        if (!w || w.value === value) return;
        done.push([node.type, name, w.value, value]);
        w.value = value;
        w.callback?.(value);
    };
    for (const node of window.comfyAPI.app.app.graph.nodes) {
        for (const w of node.widgets ?? []) {
            if (typeof w.value === "string" && w.value in files) set(node, w.name, files[w.value]);
        }
        if (node.type === "EmptyLatentImage") {
            set(node, "width", size);
            set(node, "height", size);
        }
        if (node.type === "KSampler") set(node, "steps", steps);
    }
    return done;
}

function setWidget([type, name, value]) {
    const node = window.comfyAPI.app.app.graph.nodes.find((n) => n.type === type);
    const w = node?.widgets?.find((x) => x.name === name);
    if (!w) return false;
    w.value = value;
    w.callback?.(value);
    return true;
}

/** What of ours is outside the panels: window properties, elements in head/body, stylesheets; ids and classes. */
function hygiene() {
    const ours = (s) => /lycoris/i.test(s || "");
    const panels = [...document.querySelectorAll(".lycoris-panel")];
    const inPanel = (e) => panels.some((p) => p.contains(e));
    const names = new Set();
    // The panel root's other classes are the frontend's (1.49.6's DOM widget adds h-full w-full): its descendants.
    for (const panel of panels) {
        for (const e of panel.querySelectorAll("*")) {
            for (const c of e.classList) names.add(`.${c}`);
            if (e.id) names.add(`#${e.id}`);
        }
    }
    const describe = (e) => `<${e.tagName.toLowerCase()} id="${e.id}" class="${e.className}" href="${e.href || e.src || ""}">`;
    return {
        panels: panels.length,
        window_props: Object.getOwnPropertyNames(window).filter(ours),
        top_level: [...document.head.children, ...document.body.children]
            .filter((e) => ours(e.id) || ours(String(e.className)) || ours(e.href) || ours(e.src)
                || (e.tagName === "STYLE" && ours(e.textContent.slice(0, 2000))))
            .map(describe),
        stylesheets_outside_panels: [...document.querySelectorAll('link[rel="stylesheet"], style')]
            .filter((e) => ours(e.href) || ours(e.textContent.slice(0, 2000)))
            .filter((e) => !inPanel(e))
            .map(describe),
        unnamespaced: [...names].filter((n) => !/^[.#]lycoris-/.test(n)),
    };
}

/** Open an example from its card in the template browser and wait for its nodes (exactly its node types) in the
 * graph. A card's click can be lost (seen on a loaded 2-core machine, and once on a quiet one: the previous example
 * stayed in the graph for the whole wait): the card is clicked once more before the graph counts as wrong, and the
 * reason is kept in the warnings. */
async function openExample(page, category, name) {
    const expected = JSON.parse(readFileSync(join(EXAMPLES, `${name}.json`), "utf8")).nodes.map((n) => n.type).sort();
    for (let attempt = 1; ; attempt++) {
        await openTemplates(page, category);
        await page.locator(CARD(name)).first().click({ timeout: within(15000) });
        try {
            return await waitFor(
                page,
                `the ${name} example's nodes in the graph`,
                (want) => {
                    const types = window.comfyAPI.app.app.graph.nodes.map((n) => n.type).sort();
                    return JSON.stringify(types) === JSON.stringify(want) ? true : { ok: false, types };
                },
                expected,
                30000,
            );
        } catch (err) {
            if (attempt >= 2 || !(err instanceof CheckError)) throw err;
            warnings.push(`${name}: opened from its card a second time: ${err.message}`);
            await closeDialogs(page);
        }
    }
}

async function checks({ page, result, responses }) {
    // Template problems are collected and failed on at the end, so one run reports all of them and the panel's.
    const problems = [];
    await setRenderer(page);

    // 1. The pack's templates, as the server lists them, and the template browser's cards.
    const listed = await page.evaluate(async () => (await window.comfyAPI.api.api.fetchApi("/workflow_templates")).json());
    const category = Object.keys(listed).find((k) => names.every((n) => listed[k].includes(n)) || listed[k].includes(names[0]));
    check(category, `the server lists none of ${names} as templates: ${JSON.stringify(listed)}`);
    check(
        JSON.stringify([...listed[category]].sort()) === JSON.stringify(names),
        `templates listed for ${category}: ${listed[category]}; example_workflows has ${names}`,
    );
    result.template_category = category;
    await openTemplates(page, category);
    const thumbs = await thumbnails(page);
    result.thumbnails = thumbs;
    for (const name of names) {
        const { src, naturalWidth } = thumbs[name];
        // The card shows the thumbnail's URL (1.49.6) or a blob: URL made from its download (1.32.9).
        const path = `/workflow_templates/${category}/${name}.`;
        const fetched = responses.some((r) => r.url.includes(path) && r.status === 200);
        if (src.includes("default-template") || !fetched || !(src.includes(path) || src.startsWith("blob:"))) {
            problems.push(`the ${name} card shows ${src}, not the pack's thumbnail (${path}*: `
                + `${JSON.stringify(responses.filter((r) => r.url.includes(path)))})`);
        } else if (!(naturalWidth > 0)) problems.push(`the ${name} card's thumbnail ${src} did not load`);
    }
    await page.keyboard.press("Escape");
    await closeDialogs(page);
    mark("template_browser");

    // 2. Each example from its card.
    result.examples = {};
    for (const name of names) {
        await openExample(page, category, name);
        // The frontend fits the view and lays out the Vue nodes over the next frames: the nodes' boxes are read
        // once they have stopped moving, and when some are off screen then, again until the view is fitted (a fit
        // can come after a still moment on a busy machine; the check is unchanged: a node still off screen fails).
        let shown = await settled(page, `the ${name} example's nodes`, graphView);
        for (const deadline = Date.now() + within(10000); shown.off.length && Date.now() < deadline;) {
            await frames(page, 2);
            shown = await page.evaluate(graphView);
        }
        const dialogs = await closeDialogs(page);
        result.examples[name] = { dialogs, off_screen: shown.off };
        if (shown.off.length) problems.push(`${name}: nodes not on screen when it opens: ${JSON.stringify(shown.off)}`);
    }
    mark("examples_opened");

    // 3. The loader's panel: fresh, after a run, after a cached re-run (the page reopened, the same prompt again).
    await openExample(page, category, LOADER_EXAMPLE);
    await settled(page, "the loader example's nodes", graphView);
    await closeDialogs(page);
    result.substituted = await page.evaluate(runOnDemo, DEMO);
    check(await page.evaluate(setWidget, [LOADER_TYPE, "strength_model", STRENGTH]), "no strength_model widget");
    const fresh = await waitFor(
        page,
        "the fresh panel: the file's metadata and the hint to run",
        (t) => {
            const s = window.__tourPanel(t);
            return s.ok && s.algos.length && s.text.includes("run the workflow") ? s : { ...s, ok: false };
        },
        LOADER_TYPE,
    );
    check(fresh.lines.length === 0 && fresh.bars === 0, `a report before any run: ${fresh.text}`);
    result.fresh = fresh;

    await queueAndWait(page, LOADER_TYPE);
    const ran = await waitFor(
        page,
        "the coverage line after the run",
        ([t, cov]) => {
            const s = window.__tourPanel(t);
            return s.ok && s.lines.join(" ").includes(cov) && s.bars > 0 ? s : { ...s, ok: false };
        },
        [LOADER_TYPE, COVERAGE],
    );
    check(!ran.text.includes(IDLE) && ran.cached.length === 0, `after the run: ${ran.text}`);
    check(ran.errors.length === 0, `the panel shows an error: ${ran.errors}`);
    result.after_run = ran;
    mark("ran");

    await reopenUI(page);
    await closeDialogs(page);
    const reopened = await waitFor(
        page,
        "the reopened workflow's panel",
        (t) => {
            const s = window.__tourPanel(t);
            return s.ok && s.algos.length ? s : { ...s, ok: false };
        },
        LOADER_TYPE,
    );
    result.reopened = reopened;
    await queueAndWait(page, LOADER_TYPE, true);
    let cached;
    try {
        cached = await waitFor(
            page,
            "the run's coverage line after the cached re-run",
            ([t, line]) => {
                const s = window.__tourPanel(t);
                return s.ok && s.lines.join(" ") === line ? s : { ...s, ok: false };
            },
            [LOADER_TYPE, ran.lines.join(" ")],
            20000,
        );
    } catch (err) {
        result.after_cached_run = await page.evaluate((t) => window.__tourPanel(t), LOADER_TYPE);
        throw err;
    }
    check(!cached.text.includes(IDLE), `after the cached re-run the panel says "${IDLE}": ${cached.text}`);
    check(cached.bars === ran.bars, `after the cached re-run: ${cached.bars} bars, the run had ${ran.bars}`);
    check(cached.cached.length === 1, `the panel does not say the report is from the cache: ${cached.text}`);
    result.after_cached_run = cached;
    mark("cached_rerun");

    // 4. Hygiene, and what the pack's files answered.
    const clean = await page.evaluate(hygiene);
    result.hygiene = clean;
    check(clean.panels > 0, "no panel on the page");
    check(clean.window_props.length === 0, `window properties of ours: ${clean.window_props}`);
    check(clean.top_level.length === 0, `elements of ours in document.head/body: ${clean.top_level}`);
    check(clean.stylesheets_outside_panels.length === 0, `stylesheets of ours outside the panels: ${clean.stylesheets_outside_panels}`);
    check(clean.unnamespaced.length === 0, `ids/classes in the panel not under lycoris-: ${clean.unnamespaced}`);
    const bad = responses.filter((r) => r.status === 404 || r.status >= 500);
    result.pack_requests = responses.length;
    if (bad.length) problems.push(`requests for the pack's files that failed: ${JSON.stringify(bad)}`);
    check(problems.length === 0, problems.join("; "));
    check(responses.some((r) => /lycoris_panel\.css/.test(r.url) && r.status < 400), "lycoris_panel.css was never loaded");
    result.ok = true;
}

const responses = [];
runBrowserScript({
    name: "tour.mjs",
    workflowPath: join(EXAMPLES, `${LOADER_EXAMPLE}.json`),
    nodeType: LOADER_TYPE,
    closeUp: { scale: 1.5, top: 120 },
    // The state reader; its name is the test's (the hygiene check looks for the pack's names).
    initScript: `window.__tourPanel = ${loaderPanel};`,
    stateKey: "panel",
    readState: (page) => page.evaluate((t) => window.__tourPanel?.(t), LOADER_TYPE),
    onPage: (page) =>
        page.on("response", (r) => {
            const url = r.url();
            if (OURS.test(url)) responses.push({ status: r.status(), url });
        }),
    body: (ctx) => checks({ ...ctx, responses }),
});
