// The pack's entries in ComfyUI's settings dialog: what a LoRA dropped on empty canvas makes, and Exact everywhere.
// Only exports: the frontend imports every file under web/.

import { api } from "../../../scripts/api.js";
import { DROP_CORE, DROP_OURS, DROP_SETTING, registerModelDrops } from "./model_drop.js";

// --- Exact everywhere ------------------------------------------------------------------------------------------------
//
// The server reads this setting (nodes/glue/everywhere.py) when a prompt is queued. ComfyUI keeps each node's
// outputs while its inputs stay the same, so after a switch every loader would still hand on the models it patched
// before: the switch asks the server to drop them (/free, as ComfyUI's own "Unload models" button does), and the
// next queue loads every LoRA again, the new way. Frontends call onChange once at start-up with no old value.

const EVERYWHERE_SETTING = "LycorisNodes.ExactEverywhere";

async function everywhereChanged(value, old) {
    if (old === undefined || old === null || value === old) return;
    const resp = await api.fetchApi("/free", {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify({ unload_models: true, free_memory: true }),
    });
    if (!resp.ok) console.error(`[lycoris_panel] ${EVERYWHERE_SETTING}: /free answered ${resp.status}`);
}

/** The extension's `settings`. */
export const SETTINGS = [
    {
        id: DROP_SETTING,
        category: ["LyCORIS Nodes", "Model library", "Drop on canvas"],
        name: "A LoRA dropped from the model library onto empty canvas makes",
        tooltip: "Dropped onto a LyCORIS node, a LoRA always fills its file. On empty canvas it makes this node.",
        type: "combo",
        options: [DROP_CORE, DROP_OURS],
        defaultValue: DROP_CORE,
        onChange: (value) => registerModelDrops(value),
    },
    {
        id: EVERYWHERE_SETTING,
        category: ["LyCORIS Nodes", "Exactness", "Every LoRA loader"],
        name: "Apply every LoRA loader's files with LyCORIS Nodes",
        tooltip:
            "On: ComfyUI's own Load LoRA, its hook and bypass loaders, and loaders of other packs built on them " +
            "apply every file with this pack's maths and names, as LyCORIS Loader does in merge mode. Off (the " +
            "default): ComfyUI's own behaviour. Takes effect at the next queue. The environment variable " +
            "LYCORIS_EXACT_EVERYWHERE=1 or 0 overrides this.",
        type: "boolean",
        defaultValue: false,
        onChange: (value, old) => {
            everywhereChanged(value, old).catch((e) => console.error(`[lycoris_panel] ${EVERYWHERE_SETTING}:`, e));
        },
    },
];
