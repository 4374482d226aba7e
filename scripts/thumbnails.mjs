// Screenshots of the example workflows as the frontend opens them, for scripts/make_thumbnails.py.
//
// Env: COMFY_URL (a ComfyUI with the pack), EXAMPLES_DIR (the .json files), OUT_DIR (one <name>.png each),
// RENDERER=classic|vue (default classic), CHROMIUM (default /usr/bin/chromium).
// Opens the UI in headless Chromium (playwright-core from tests/browser/node_modules), loads each workflow the way
// the template browser does (app.loadGraphData with the saved view), and saves the page. Prints one JSON line:
// {ok, frontend_version, workflows: {name: {nodes: [{id, type, title, box: [x0, y0, x1, y1]}], canvas: [w, h]}}}
// with each node's box in page pixels (title bar included), as drawn.

import { createRequire } from "node:module";
import { mkdtempSync, readdirSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

const REPO = resolve(dirname(fileURLToPath(import.meta.url)), "..");
const { chromium } = createRequire(join(REPO, "tests", "browser", "package.json"))("playwright-core");
const { COMFY_URL, EXAMPLES_DIR, OUT_DIR } = process.env;
const RENDERER = process.env.RENDERER || "classic";
const VIEWPORT = { width: 1600, height: 1000 };

if (!COMFY_URL || !EXAMPLES_DIR || !OUT_DIR) {
    console.error("usage: COMFY_URL=... EXAMPLES_DIR=... OUT_DIR=... node scripts/thumbnails.mjs");
    process.exit(2);
}

function nodeBoxes() {
    const app = window.comfyAPI.app.app;
    const canvas = app.canvas;
    const rect = canvas.canvas.getBoundingClientRect();
    const title = window.LiteGraph.NODE_TITLE_HEIGHT;
    return {
        canvas: [rect.width, rect.height],
        canvas_rect: [rect.x, rect.y, rect.width, rect.height],
        ds: { scale: canvas.ds.scale, offset: [...canvas.ds.offset] },
        nodes: app.graph.nodes.map((node) => {
            const vueEl = document.querySelector(`.lg-node[data-node-id="${node.id}"]`);
            let box;
            if (vueEl && vueEl.offsetParent !== null) {
                const r = vueEl.getBoundingClientRect();
                box = [r.left, r.top, r.right, r.bottom];
            } else {
                const [x, y] = canvas.ds.convertOffsetToCanvas([node.pos[0], node.pos[1] - title]);
                const s = canvas.ds.scale;
                box = [rect.x + x, rect.y + y, rect.x + x + node.size[0] * s, rect.y + y + (node.size[1] + title) * s];
            }
            return { id: node.id, type: node.type, title: node.title, box: box.map((v) => Math.round(v)) };
        }),
    };
}

const profile = mkdtempSync(join(tmpdir(), "lycoris-thumbnails-"));
const result = { ok: false, renderer: RENDERER, workflows: {} };
let context;
try {
    context = await chromium.launchPersistentContext(profile, {
        executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
        headless: true,
        args: ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"],
        viewport: VIEWPORT,
    });
    const page = context.pages()[0] ?? (await context.newPage());
    await page.goto(COMFY_URL);
    await page.waitForFunction(() => window.comfyAPI?.app?.app?.graph && window.comfyAPI.app.app.canvas, null,
        { timeout: 60000 });
    result.frontend_version = await page.evaluate(() => window.__COMFYUI_FRONTEND_VERSION__ ?? null);
    await page.evaluate((vue) => window.comfyAPI.app.app.extensionManager.setting.set("Comfy.VueNodes.Enabled", vue),
        RENDERER === "vue");
    await page.waitForTimeout(1000);
    for (const file of readdirSync(EXAMPLES_DIR).filter((f) => f.endsWith(".json")).sort()) {
        const workflow = JSON.parse(readFileSync(join(EXAMPLES_DIR, file), "utf8"));
        await page.evaluate((wf) => window.comfyAPI.app.app.loadGraphData(wf), workflow);
        await page.waitForTimeout(1500); // DOM widgets (textareas, notes) and Vue nodes follow the canvas
        await page.mouse.move(VIEWPORT.width - 5, VIEWPORT.height - 5);
        const name = file.replace(/\.json$/, "");
        await page.screenshot({ path: join(OUT_DIR, `${name}.png`) });
        result.workflows[file] = await page.evaluate(nodeBoxes);
    }
    result.ok = true;
} catch (err) {
    result.error = String(err?.stack || err);
} finally {
    if (context) await context.close().catch(() => {});
    rmSync(profile, { recursive: true, force: true });
}
console.log(JSON.stringify(result));
process.exit(result.ok ? 0 : 1);
