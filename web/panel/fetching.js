// The panel's requests to the server: a file's metadata (GET /lycoris/info), and the report of an earlier run for a
// node ComfyUI answered from its cache or for a workflow just opened (GET /queue, /history). Only exports: the
// frontend imports every file under web/.

import { app } from "../../../scripts/app.js";
import { api } from "../../../scripts/api.js";
import { livePanels } from "./state.js";

// Reports of earlier runs looked up for a node ComfyUI answered from its cache: the newest entries first, then more.
const HISTORY_PAGES = [32, 512];
const PROMPT_LOOKUPS = 20; // tries to read the cached run's own prompt (queue, then history), PROMPT_RETRY_MS apart
const PROMPT_RETRY_MS = 150;

/** The metadata of a file in the loras folder: `{info, error}`, one of them null; failures are the error's text. */
export async function fetchInfo(name) {
    let info = null;
    let error = null;
    try {
        const resp = await api.fetchApi(`/lycoris/info?name=${encodeURIComponent(name)}`);
        let body = null;
        try {
            body = await resp.json();
        } catch {
            body = null;
        }
        if (!resp.ok) error = body?.error || `HTTP ${resp.status} ${resp.statusText || ""}`.trim();
        else if (!body || typeof body !== "object") error = "unexpected answer from /lycoris/info";
        else info = body;
    } catch (e) {
        error = `could not load metadata: ${e?.message || e}`;
    }
    return { info, error };
}

// --- nodes answered from ComfyUI's cache -------------------------------------------------------------------------
//
// When a node's inputs are those of an earlier run, ComfyUI reuses that run's output: the node does not execute and
// no "executed" message (no report) is sent; only "execution_cached" lists it. The report is in the server's history
// (GET /history: every prompt with its nodes' UI outputs): the newest earlier prompt in which this node ran with the
// same inputs, from the same upstream nodes, is the run whose output was reused.

async function getJson(path) {
    const resp = await api.fetchApi(path);
    if (!resp.ok) throw new Error(`GET ${path}: HTTP ${resp.status}`);
    return await resp.json();
}

/** What ComfyUI's cache key is made of: the node's class and inputs, with each link replaced by its source's. */
function signature(prompt, id, memo = new Map()) {
    if (memo.has(id)) return memo.get(id);
    const node = prompt?.[id];
    let sig = null;
    if (node && typeof node === "object") {
        memo.set(id, null); // a cycle (none in a valid prompt) ends here
        const inputs = Object.keys(node.inputs ?? {}).sort().map((key) => {
            const value = node.inputs[key];
            const link = Array.isArray(value) && value.length === 2 && typeof value[1] === "number" && value[0] in prompt;
            return [key, link ? [signature(prompt, String(value[0]), memo), value[1]] : value];
        });
        sig = JSON.stringify([node.class_type, inputs]);
    }
    memo.set(id, sig);
    return sig;
}

/** The API prompt of a queued or finished prompt, or null. */
async function promptOf(promptId) {
    for (let i = 0; i < PROMPT_LOOKUPS; i++) {
        const queue = await getJson("/queue");
        const item = [...(queue.queue_running ?? []), ...(queue.queue_pending ?? [])].find((q) => q?.[1] === promptId);
        if (item) return item[2];
        const done = await getJson(`/history/${encodeURIComponent(promptId)}`);
        if (done?.[promptId]?.prompt) return done[promptId].prompt[2];
        // Between the queue and the history: the run just ended.
        await new Promise((resolve) => setTimeout(resolve, PROMPT_RETRY_MS));
    }
    return null;
}

/**
 * The report of the newest run, other than promptId, in which a node ran with the inputs node `id` has in `prompt`:
 * ComfyUI's cache is keyed by inputs, not by node id, so the run may be another workflow's, under another id.
 */
async function lastReport(promptId, prompt, id) {
    const want = signature(prompt, id);
    if (!want) return null;
    for (const items of HISTORY_PAGES) {
        const history = await getJson(`/history?max_items=${items}`);
        const entries = Object.entries(history ?? {}).reverse(); // the server lists them oldest first
        for (const [pid, entry] of entries) {
            if (pid === promptId) continue;
            const memo = new Map();
            // This node's own id first: the same workflow run again.
            const ids = Object.keys(entry?.outputs ?? {}).sort((a, b) => (b === id) - (a === id));
            for (const other of ids) {
                const output = entry.outputs[other]?.lycoris;
                const report = Array.isArray(output) ? output[0] : output;
                if (report && typeof report === "object" && signature(entry.prompt?.[2], other, memo) === want) {
                    return report;
                }
            }
        }
        if (entries.length < items) break; // that was all of it
    }
    return null;
}

/** The "execution_cached" message: the panels of the nodes it lists show the report of the run that was reused. */
export async function restoreCached(detail) {
    const ids = new Set((detail?.nodes ?? []).map(String));
    const panels = [...livePanels].filter((panel) => ids.has(String(panel.node.id)));
    if (!panels.length || !detail.prompt_id) return;
    for (const panel of panels) panel.onCachedStart();
    let prompt = null;
    try {
        prompt = await promptOf(detail.prompt_id);
    } catch (e) {
        console.error("[lycoris_panel] reading the cached run's prompt:", e);
    }
    for (const panel of panels) {
        let report = null;
        try {
            report = prompt && (await lastReport(detail.prompt_id, prompt, String(panel.node.id)));
        } catch (e) {
            console.error("[lycoris_panel] looking up a cached node's report:", e);
        }
        panel.onCached(report);
    }
}

/**
 * After a workflow is opened (a page reload restores the open one): the panels have no report, since the frontend
 * keeps none across a reload. The report of the newest run in which a node ran with the inputs it has now is in the
 * server's history, found as for a cached run; panels whose inputs match no kept run stay as they are.
 */
export async function restoreFromHistory() {
    const panels = [...livePanels].filter((panel) => !panel.report && panel.node.graph);
    if (!panels.length) return;
    const prompt = (await app.graphToPrompt())?.output;
    if (!prompt) return;
    for (const panel of panels) {
        const report = await lastReport(null, prompt, String(panel.node.id));
        // Not when a run's own report arrived meanwhile.
        if (report && !panel.report && livePanels.has(panel)) panel.onExecuted({ lycoris: [report] }, "reloaded");
    }
}
