// The README's picture: the LyCORIS Loader with its panel after a run (driven by screenshot_panel.py).
//
//   COMFY_URL=http://127.0.0.1:8188/ SCREENSHOT=/tmp/shot.png WORKFLOW=loader.json node tests/browser/screenshot.mjs
//
// Loads WORKFLOW (the loader example on the demo files), queues it, waits for the panel's coverage line and chart;
// common.mjs then saves SCREENSHOT and the close-up of the loader node as "<name>-node.png".

import { check, loadWorkflow, queueAndWait, runBrowserScript, setRenderer, waitFor } from "./common.mjs";

const LOADER_TYPE = "LycorisLoader";

runBrowserScript({
    name: "screenshot.mjs",
    workflowPath: process.env.WORKFLOW,
    nodeType: LOADER_TYPE,
    closeUp: { scale: 1.4, top: 200 }, // the title below the frontend's menus, the node within the page
    body: async ({ page, result, workflow }) => {
        await setRenderer(page);
        await loadWorkflow(page, workflow);
        await queueAndWait(page, LOADER_TYPE);
        const bars = await waitFor(page, "the panel's chart", (t) => {
            const node = window.comfyAPI.app.app.graph.nodes.find((n) => n.type === t);
            const root = node?.widgets?.find((w) => w.name === "lycoris_panel")?.element;
            return root?.querySelectorAll(".lycoris-chart .lycoris-bar").length || false;
        }, LOADER_TYPE, 15000);
        check(bars > 0, "no chart in the panel");
        // Nothing selected or hovered in the picture.
        await page.evaluate(() => window.comfyAPI.app.app.canvas.deselectAll?.());
        result.ok = true;
    },
});
