// LyCORIS panel: what a LyCORIS file is (GET /lycoris/info) and what it did (the node's "lycoris" UI output).
//
// One DOM widget named "lycoris_panel" on each node type below. It is plain DOM (no canvas drawing), so the same
// element shows in the classic LiteGraph canvas and in the Vue "Nodes 2.0" renderer. It is not serialized: workflow
// JSON and widgets_values stay exactly as without the extension.
//
// On LyCORIS Loader (Block Weights) the panel also has a slider per block the file touches (known after a run of the
// node, or of a LyCORIS Block Info node for the same file); a slider rewrites the node's `block_weights` text as named
// rules (lycoris_block_rules.js), which is what is saved and sent: the sliders themselves are not.
//
// The tools (Save, Resize, Extract, Convert LyCORIS) get a DOM widget named "lycoris_report" instead: the text report
// the node returns (ui "text": the file written, then form, rank and measured error per module), lines kept.
//
// LyCORIS Loader (Rows) and (Wan 2.2 Experts) get the rows editor, "lycoris_rows" (web/panel/rows_editor.js): a line
// per file drawn from the node's `rows` text and written back into it, with the run's report (ui "lycoris_rows")
// under each row; the text stays what is saved and sent.
//
// This file only registers the extension; the parts are in web/panel/ (the widgets in widgets.js, the panel in
// panel.js, view.js and block_editor.js, the server requests in fetching.js, the model-library drop in model_drop.js,
// the settings in settings.js). The frontend imports every .js file under web/, so those only export.

import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { restoreCached, restoreFromHistory } from "./panel/fetching.js";
import { noteDropType, registerModelDrops, watchDrags } from "./panel/model_drop.js";
import { NODE_TYPES, ROWS_TYPES, TOOL_TYPES } from "./panel/names.js";
import { addRowsEditor, restoreRowsReports } from "./panel/rows_editor.js";
import { SETTINGS } from "./panel/settings.js";
import { addPanel, addReport } from "./panel/widgets.js";

const extension = {
    name: "lycoris_nodes.panel",

    settings: SETTINGS,

    setup() {
        api.addEventListener("execution_cached", ({ detail }) => {
            restoreCached(detail).catch((e) => console.error("[lycoris_panel] execution_cached:", e));
        });
        watchDrags();
        registerModelDrops(); // last: a store of another shape that throws must not cost the rest of the set-up
    },

    async beforeRegisterNodeDef(nodeType, nodeData) {
        noteDropType(nodeData);
        if (ROWS_TYPES.includes(nodeData.name)) {
            const onRowsExecuted = nodeType.prototype.onExecuted;
            nodeType.prototype.onExecuted = function (output) {
                const result = onRowsExecuted?.apply(this, arguments);
                try {
                    this.lycorisRows?.onExecuted(output);
                } catch (e) {
                    console.error("[lycoris_panel] rows report:", e);
                }
                return result;
            };
            return;
        }
        if (TOOL_TYPES.includes(nodeData.name)) {
            const onToolExecuted = nodeType.prototype.onExecuted;
            nodeType.prototype.onExecuted = function (output) {
                const result = onToolExecuted?.apply(this, arguments);
                try {
                    this.lycorisReport?.show(output);
                } catch (e) {
                    console.error("[lycoris_panel] tool report:", e);
                }
                return result;
            };
            return;
        }
        if (!NODE_TYPES.includes(nodeData.name)) return;
        const onExecuted = nodeType.prototype.onExecuted;
        nodeType.prototype.onExecuted = function (output) {
            const result = onExecuted?.apply(this, arguments);
            try {
                this.lycorisPanel?.onExecuted(output);
            } catch (e) {
                console.error("[lycoris_panel] onExecuted:", e);
            }
            return result;
        };
    },

    nodeCreated(node) {
        if (ROWS_TYPES.includes(node.comfyClass)) {
            try {
                addRowsEditor(node);
            } catch (e) {
                console.error("[lycoris_panel] could not add the rows editor:", e);
            }
            return;
        }
        if (TOOL_TYPES.includes(node.comfyClass)) {
            try {
                addReport(node);
            } catch (e) {
                console.error("[lycoris_panel] could not add the tool report:", e);
            }
            return;
        }
        if (!NODE_TYPES.includes(node.comfyClass)) return;
        try {
            addPanel(node);
        } catch (e) {
            console.error("[lycoris_panel] could not add the panel:", e);
        }
    },

    afterConfigureGraph() {
        // After the nodes' own refresh (addPanel's setTimeout), so a report found here is not overwritten by it.
        setTimeout(() => {
            restoreFromHistory().catch((e) => console.error("[lycoris_panel] restoring the last run's report:", e));
            restoreRowsReports().catch((e) => console.error("[lycoris_panel] restoring the rows' last report:", e));
        }, 0);
    },

    loadedGraphNode(node) {
        if (!NODE_TYPES.includes(node.comfyClass)) return;
        node.lycorisPanel?.refresh();
    },
};

/** Already registered: ComfyUI serves the web folder under two URLs when the pack's folder name differs from its
 * pyproject name and both WEB_DIRECTORY and [tool.comfy] web name it, and the frontend then imports this file twice. */
function registered() {
    try {
        return (app.extensions ?? []).some((e) => e?.name === extension.name);
    } catch {
        return false; // the extension store is not set up yet: nothing is registered
    }
}

if (!registered()) app.registerExtension(extension);
