// LoRAs dropped from the model library. Only exports: the frontend imports every file under web/.
//
// The frontend (1.32 to 1.58) decides what a model dropped from its model library does with a table from model folder
// to (node type, widget name): dropped onto a node listed there, the node's widget takes the file; dropped on empty
// canvas, the first entry's node is made. Node packs have no public way to add to the table: it is the Pinia store
// "modelToNode", reached here through the Vue app, behind feature detection. Without it (another frontend, the store
// renamed) nothing changes: a drop makes ComfyUI's own Load LoRA, as without this pack.

import { app } from "../../../scripts/app.js";
import { NAME_WIDGET } from "./names.js";
import { livePanels } from "./state.js";

const DROP_FOLDER = "loras";
export const DROP_SETTING = "LycorisNodes.ModelLibrary.DropOnCanvas";
export const DROP_CORE = "ComfyUI's Load LoRA";
export const DROP_OURS = "LyCORIS Loader";
const FIRST_DROP_TYPE = "LycorisLoader"; // made by an empty-canvas drop when the setting says so
const dropTypes = []; // the pack's node types with a lycoris_name file combo, from their definitions

/** Note a node type (its definition, as beforeRegisterNodeDef gets it) for the drop table if it has a file combo. */
export function noteDropType(nodeData) {
    const fileInput = nodeData.input?.required?.[NAME_WIDGET];
    if (Array.isArray(fileInput) && !dropTypes.includes(nodeData.name)) dropTypes.push(nodeData.name);
}

/** The frontend's store, or null when this frontend has none of that shape (every step is checked, nothing caught). */
function modelToNodeStore() {
    const pinia = document.querySelector("#vue-app")?.__vue_app__?.config?.globalProperties?.$pinia;
    const store = pinia?._s?.get?.("modelToNode");
    const usable = ["quickRegister", "getAllNodeProviders"].every((f) => typeof store?.[f] === "function");
    return usable ? store : null;
}

/**
 * Our node types in the drop table (once each), and ours first or last for an empty-canvas drop. `choice`: the setting's
 * value, passed by its onChange: frontends 1.32 and 1.49 call onChange before they store the new value, so reading the
 * setting there gives the old one (1.58 stores it first).
 */
export function registerModelDrops(choice = app.extensionManager?.setting?.get?.(DROP_SETTING)) {
    const store = modelToNodeStore();
    if (!store) return false;
    const providers = () => store.getAllNodeProviders(DROP_FOLDER) ?? [];
    const isOurs = (p) => dropTypes.includes(p?.nodeDef?.name);
    for (const type of dropTypes) {
        if (!providers().some((p) => p?.nodeDef?.name === type)) store.quickRegister(DROP_FOLDER, type, NAME_WIDGET);
    }
    const list = providers();
    if (!Array.isArray(list)) return false;
    const ours = list.filter(isOurs).sort((a, b) => (b.nodeDef.name === FIRST_DROP_TYPE) - (a.nodeDef.name === FIRST_DROP_TYPE));
    const core = list.filter((p) => !isOurs(p));
    const first = choice === DROP_OURS;
    list.splice(0, list.length, ...(first ? [...ours, ...core] : [...core, ...ours])); // the store's own array
    return true;
}

// While a drag (of a model-library entry, or anything) is over the page: the panels let it through to the canvas
// under them, which is the drop target (in the classic renderer a panel covers most of its node); and a drop in
// progress, during which the frontend assigns the dropped file to the node's widget.
let dropping = false;

/** True during a drop's dispatch: a widget value assigned now is the dropped file. */
export function dropInProgress() {
    return dropping;
}

export function watchDrags() {
    // The panel, and the frontend's wrapper around it when that holds nothing else (1.49+: div.dom-widget), which
    // takes the pointer too.
    const layers = (panel) => {
        const wrapper = panel.root.parentElement;
        return wrapper && wrapper.childElementCount === 1 ? [panel.root, wrapper] : [panel.root];
    };
    const through = (on) => {
        for (const panel of livePanels) {
            for (const layer of layers(panel)) {
                if (on) {
                    layer.dataset.lycorisPointer ??= layer.style.pointerEvents;
                    layer.style.pointerEvents = "none";
                } else if (layer.dataset.lycorisPointer !== undefined) {
                    layer.style.pointerEvents = layer.dataset.lycorisPointer;
                    delete layer.dataset.lycorisPointer;
                }
            }
        }
    };
    window.addEventListener("dragstart", () => through(true), true);
    for (const type of ["dragend", "drop"]) window.addEventListener(type, () => through(false), true);
    window.addEventListener("drop", () => {
        dropping = true;
        setTimeout(() => (dropping = false), 0); // the frontend's drop handler runs in this event's dispatch
    }, true);
}
