// The rows editor of LyCORIS Loader (Rows) and (Wan 2.2 Experts) (issue #36): a DOM widget ("lycoris_rows") that
// draws one line per file from the node's `rows` text and writes the text back on every edit. The text (a JSON list,
// web/panel/rows_model.js) is what is saved and sent; the editor is not serialized, and the `rows` textarea is
// hidden in both renderers (the editor's own "text" switch shows the text to edit by hand). After a run it shows the
// node's report (UI output "lycoris_rows") under the rows it is about. Plain DOM, like the panel, so the classic
// canvas and the Vue renderer show the same element. Only exports: the frontend imports every file under web/.

import { app } from "../../../scripts/app.js";
import { api } from "../../../scripts/api.js";
import { parseBlockWeights } from "../lycoris_block_rules.js";
import { el, fmtNum, keepEvents, stylesheet } from "./format.js";
import { EXPERTS_TYPE, ROWS_EDITOR_WIDGET, ROWS_WIDGET } from "./names.js";
import {
    EXPERT_CHOICES, addRow, moveRow, parseRows, removeRow, reportByRow, rowsText, setField, toggleAll,
} from "./rows_model.js";

const MARGIN = 8; // px around the editor inside the node (the DOM widget default is 10)
const LORAS_MAX_AGE_MS = 10000; // the loras list is asked again on a file field's focus when older than this
const HISTORY_ITEMS = 32; // runs looked through for the last report of a workflow just opened
const EXPERT_ARROW = { high: "→ high-noise", low: "→ low-noise" };
const SOURCE_NAME = { stack: "lora_stack", text: "lora_text" };
const liveEditors = new Set();
let datalists = 0;

// --- the loras folder's files, for every editor's file list -----------------------------------------------------

let loras = null; // {at, names: Promise<string[] | null>}

/** The files of the loras folders (subfolders included), asked once and again when older than LORAS_MAX_AGE_MS. */
function loraNames(refresh = false) {
    if (loras && !(refresh && Date.now() - loras.at > LORAS_MAX_AGE_MS)) return loras.names;
    const names = api.fetchApi("/models/loras").then(async (resp) => {
        if (!resp.ok) throw new Error(`HTTP ${resp.status}`);
        const body = await resp.json();
        return Array.isArray(body) ? body.filter((n) => typeof n === "string") : [];
    }).catch((e) => {
        console.warn("[lycoris_panel] GET /models/loras (the rows' file list):", e);
        return null;
    });
    loras = { at: Date.now(), names };
    return names;
}

// --- the editor ---------------------------------------------------------------------------------------------------

export class RowsEditor {
    constructor(node) {
        this.node = node;
        this.experts = node.comfyClass === EXPERTS_TYPE;
        this.rows = []; // what the text says, or null when it cannot be read (this.error)
        this.error = null;
        this.text = null; // the text this.rows was read from
        this.report = null; // the last run's entries (UI output "lycoris_rows")
        this.reportNote = null; // how the report came back when not from a run of this page
        this.listed = null; // the loras folder's files, once known
        this.showText = false;
        this.lastHeight = 0;

        this.list = el("datalist");
        this.list.id = `lycoris-rows-loras-${++datalists}`;
        this.content = el("div", "lycoris-content lycoris-rows-content");
        this.area = this.textArea();
        this.root = el("div", "lycoris-panel lycoris-rows");
        this.root.append(stylesheet(), this.content, this.list);
        this.root.addEventListener("wheel", (e) => this.onWheel(e), { passive: false });
        if (typeof ResizeObserver === "function") {
            this.observer = new ResizeObserver(() => this.fitNode());
            this.observer.observe(this.content);
        }
        liveEditors.add(this);
        this.fillList(loraNames());
    }

    dispose() {
        this.observer?.disconnect();
        liveEditors.delete(this);
    }

    textWidget() {
        return this.node.widgets?.find((w) => w.name === ROWS_WIDGET);
    }

    clipLinked() {
        const slot = this.node.inputs?.findIndex((i) => i.name === "clip") ?? -1;
        if (slot < 0) return false;
        // isInputConnected where there is one: frontend 1.58 warns on reading input.link.
        const node = this.node;
        return typeof node.isInputConnected === "function" ? node.isInputConnected(slot) : node.inputs[slot].link != null;
    }

    /** Read the rows from the widget's text (after a load, an undo, a typed text) and draw them. */
    load() {
        const text = String(this.textWidget()?.value ?? "");
        const { rows, error } = parseRows(text);
        this.text = text;
        this.rows = rows;
        this.error = error;
        if (error) this.showText = true; // the text is where it can be put right
        if (this.area.value !== text && document.activeElement !== this.area) this.area.value = text;
        this.render();
    }

    /** Apply `change` (rows -> rows) and write the text; `redraw`: the rows' lines change (not only a value). */
    edit(change, redraw = true) {
        if (String(this.textWidget()?.value ?? "") !== this.text) {
            this.load(); // changed behind the editor's back: what was clicked may no longer be there
            return;
        }
        if (!this.rows) return;
        const rows = change(this.rows);
        if (rows === this.rows) return;
        this.rows = rows;
        this.setText(rowsText(rows), true);
        this.area.value = this.text;
        if (redraw) this.render();
    }

    /** Set the `rows` text as if typed: the value, callbacks, and a modified graph (an undo step with `commit`). */
    setText(text, commit) {
        const widget = this.textWidget();
        if (!widget) return;
        const old = String(widget.value ?? "");
        this.text = text;
        if (text === old) return;
        widget.value = text;
        // The hidden textarea, where the frontend does not sync it from the value itself (the classic renderer).
        const area = widget.element;
        if (area && "value" in area && area.value !== text) area.value = text;
        try {
            widget.callback?.(text, app.canvas, this.node, undefined, undefined);
            this.node.onWidgetChanged?.(widget.name, text, old, widget);
        } catch (e) {
            console.error("[lycoris_panel] rows callback:", e);
        }
        this.markChanged(commit);
    }

    /** The graph changed: redraw; with `commit`, also the workflow's "modified" mark and an undo step. */
    markChanged(commit) {
        (this.node.graph ?? app.graph)?.change?.();
        this.node.setDirtyCanvas?.(true, true);
        app.canvas?.setDirty?.(true, true);
        if (commit) {
            // captureCanvasState since frontend 1.58 (checkState, its old name, warns there).
            const tracker = app.extensionManager?.workflow?.activeWorkflow?.changeTracker;
            (tracker?.captureCanvasState ?? tracker?.checkState)?.call(tracker);
        }
    }

    /** A run's report: the node's UI output `lycoris_rows`; `note`: how it came back when not from a run seen here. */
    onExecuted(output, note = null) {
        const entries = output?.lycoris_rows;
        if (!Array.isArray(entries)) return;
        this.report = entries;
        this.reportNote = note;
        this.render();
    }

    /** After a workflow is opened: the report of the newest kept run of this node with these rows, if any. */
    async restoreReport() {
        if (this.report || !this.node.graph) return;
        const resp = await api.fetchApi(`/history?max_items=${HISTORY_ITEMS}`);
        if (!resp.ok) throw new Error(`GET /history: HTTP ${resp.status}`);
        const history = await resp.json();
        const id = String(this.node.id);
        for (const entry of Object.values(history ?? {}).reverse()) { // the server lists them oldest first
            const input = entry?.prompt?.[2]?.[id];
            const output = entry?.outputs?.[id];
            if (input?.class_type === this.node.comfyClass && input.inputs?.rows === this.text && output?.lycoris_rows) {
                if (!this.report) this.onExecuted(output, "the last run's report (restored)");
                return;
            }
        }
    }

    // --- drawing ------------------------------------------------------------------------------------------------

    render() {
        try {
            this.content.replaceChildren(...this.sections());
        } catch (e) {
            // Never break the node: show what went wrong instead (and log it).
            console.error("[lycoris_panel] rows editor:", e);
            this.content.replaceChildren(el("div", "lycoris-status lycoris-error", `rows editor error: ${e?.message || e}`));
        }
        this.root.dataset.nodeId = String(this.node.id);
        this.fitNode();
    }

    sections() {
        const out = [this.header()];
        if (this.error) out.push(el("div", "lycoris-status lycoris-error lycoris-rows-error", `rows: ${this.error}`));
        if (this.rows) {
            const { byRow, others } = reportByRow(this.report, this.rows);
            const list = el("div", "lycoris-rows-list");
            this.rows.forEach((row, i) => list.appendChild(this.rowElement(row, i, byRow[i])));
            if (!this.rows.length) list.appendChild(el("div", "lycoris-note", "no rows: add one for each file to apply"));
            out.push(list);
            if (others.length) out.push(this.othersElement(others));
        }
        if (this.reportNote && this.report) out.push(el("div", "lycoris-note lycoris-cached", this.reportNote));
        if (this.showText) out.push(this.area);
        return out;
    }

    header() {
        const box = el("div", "lycoris-rows-header");
        const count = this.rows?.length ? `${this.rows.filter((r) => r.on).length} of ${this.rows.length} rows on` : "rows";
        box.appendChild(el("span", "lycoris-rows-title", count));
        const add = this.button("+ row", "lycoris-rows-add", "Add a row (a file to apply)", () => this.edit((rows) => addRow(rows)));
        const all = this.button("all on/off", "lycoris-rows-all", "Switch every row off (or, when some are off, on)",
            () => this.edit(toggleAll));
        add.disabled = all.disabled = !this.rows;
        all.disabled ||= !this.rows.length;
        const text = this.button("text", "lycoris-rows-text-toggle", "Show the rows as the text that is saved (to edit by hand)", () => {
            this.showText = !this.showText || !!this.error;
            this.render();
        });
        text.classList.toggle("lycoris-on", this.showText);
        box.append(add, all, text);
        return box;
    }

    button(label, className, title, onClick) {
        const b = el("button", `lycoris-rows-button ${className}`, label);
        b.type = "button";
        b.title = title;
        keepEvents(b);
        b.addEventListener("click", (e) => {
            e.stopPropagation();
            onClick();
        });
        return b;
    }

    /** An <input>: keeps its events from the canvas; `onChange(value)` when the user commits a new value. */
    input(className, title, value, onChange, attrs = {}) {
        const input = el("input", `lycoris-rows-input ${className}`);
        Object.assign(input, { type: "text", ...attrs });
        input.value = value;
        input.title = title;
        keepEvents(input);
        input.addEventListener("change", () => onChange(input.value, input));
        // Enter commits, as in a form (a number field's change comes on Enter anyway; a text field's only on blur).
        input.addEventListener("keydown", (e) => e.key === "Enter" && input.blur());
        return input;
    }

    /** A number field of row `index`: empty means the default when `optional` (the key is left out), else reverts. */
    numberInput(index, key, value, title, optional = false) {
        const shown = value == null ? "" : String(value);
        const input = this.input(`lycoris-rows-${key.replace("_", "-")}`, title, shown, (text) => {
            const number = Number(text);
            if (text.trim() === "" && optional) return this.edit((rows) => setField(rows, index, key, null), false);
            if (text.trim() === "" || !isFinite(number)) {
                input.value = shown;
                return;
            }
            this.edit((rows) => setField(rows, index, key, number), false);
        }, { type: "number", step: 0.05 });
        if (optional) input.placeholder = "same";
        return input;
    }

    labelled(label, control) {
        const box = el("label", "lycoris-rows-field");
        box.append(el("span", "lycoris-rows-label", label), control);
        return box;
    }

    rowElement(row, i, entries) {
        const box = el("div", `lycoris-rows-row${row.on ? "" : " lycoris-off"}`);
        box.dataset.row = String(i + 1);
        const on = el("input", "lycoris-rows-on");
        Object.assign(on, { type: "checkbox", checked: row.on, title: "Apply this row" });
        keepEvents(on);
        on.addEventListener("change", () => this.edit((rows) => setField(rows, i, "on", on.checked)));
        const status = el("div", "lycoris-rows-status");
        const file = this.input("lycoris-rows-file", "The file (type to search the loras folder)", row.lora, (value) => {
            this.edit((rows) => setField(rows, i, "lora", value.trim()), false);
            this.fillStatus(status, this.rows?.[i]);
        }, { placeholder: "file…", spellcheck: false });
        file.setAttribute("list", this.list.id);
        file.addEventListener("focus", () => this.fillList(loraNames(true)));
        const strength = this.numberInput(i, "strength", row.strength, this.experts ? "Strength (the high-noise expert)" : "Strength");
        const main = el("div", "lycoris-rows-main");
        main.append(on, file, strength,
            this.button("↑", "lycoris-rows-up", "Move up (applies earlier)", () => this.edit((rows) => moveRow(rows, i, -1))),
            this.button("↓", "lycoris-rows-down", "Move down", () => this.edit((rows) => moveRow(rows, i, 1))),
            this.button("✕", "lycoris-rows-remove", "Remove this row", () => this.edit((rows) => removeRow(rows, i))));
        const more = el("div", "lycoris-rows-more");
        if (this.clipLinked()) {
            more.appendChild(this.labelled("clip", this.numberInput(i, "strength_clip", row.strength_clip,
                "Strength on the text encoder (empty: the strength)", true)));
        }
        if (this.experts) {
            more.appendChild(this.labelled("low", this.numberInput(i, "strength_low", row.strength_low,
                "Strength on the low-noise expert (empty: the strength)", true)));
            more.appendChild(this.labelled("expert", this.expertSelect(i, row.expert ?? "auto")));
        }
        const weights = this.input("lycoris-rows-blocks", "Block weights (as LyCORIS Loader (Block Weights) takes them; empty: none)",
            row.block_weights ?? "", (value) => {
                this.edit((rows) => setField(rows, i, "block_weights", value.trim()), false);
                this.fillStatus(status, this.rows?.[i]);
            }, { placeholder: "block weights", spellcheck: false });
        more.appendChild(weights);
        box.append(main, more, status);
        this.fillStatus(status, row);
        if (entries.length) box.appendChild(this.reportElement(entries));
        return box;
    }

    expertSelect(index, value) {
        const select = el("select", "lycoris-rows-input lycoris-rows-expert");
        select.title = "Which expert the file goes on (auto: its name says, e.g. _HIGH / _LOW)";
        for (const choice of EXPERT_CHOICES) select.appendChild(Object.assign(el("option", null, choice), { value: choice }));
        select.value = value;
        keepEvents(select);
        select.addEventListener("change", () => this.edit((rows) => setField(rows, index, "expert", select.value), false));
        return select;
    }

    /**
     * What is wrong with a row before any run: no file, a file not in the folder, block weights the server refuses.
     * A missing file on a row that is off is only a note: the server skips the row (a shared workflow still runs).
     */
    fillStatus(status, row) {
        const problems = [];
        const missing = (name) => this.listed && !this.listed.includes(name) && !this.listed.includes(name.replaceAll("\\", "/"));
        if (row && !row.lora) problems.push(["pick a file", true]);
        else if (row && missing(row.lora)) problems.push([`${row.lora} is not in the loras folder`, row.on]);
        const weights = row?.block_weights ? parseBlockWeights(row.block_weights).error : null;
        if (weights) problems.push([`block weights: ${weights}`, true]);
        status.replaceChildren(...problems.map(([text, error]) => el("div", error ? "lycoris-status lycoris-error" : "lycoris-note", text)));
    }

    /** A row's (or a tag's) report: each placement's coverage line, its verdict, the notes and trigger words. */
    reportElement(entries) {
        const box = el("div", "lycoris-rows-report");
        for (const entry of entries) {
            if (entry.off) box.appendChild(el("div", "lycoris-note", "off: not applied"));
            for (const p of Array.isArray(entry.placements) ? entry.placements : []) {
                const strengths = [p.strength_model, p.strength_clip].filter((s) => typeof s === "number").map(fmtNum).join(" / ");
                const where = [EXPERT_ARROW[p.expert], p.file !== entry.lora ? p.file : null, strengths && `@ ${strengths}`]
                    .filter(Boolean).join(" ");
                box.appendChild(el("div", "lycoris-rows-line", [where, p.line].filter(Boolean).join(": ")));
                if (p.verdict) box.appendChild(el("div", "lycoris-rows-verdict", p.verdict));
            }
            for (const note of Array.isArray(entry.notes) ? entry.notes : []) box.appendChild(el("div", "lycoris-rows-note", note));
            const words = Array.isArray(entry.trigger_words) ? entry.trigger_words : [];
            if (words.length) box.appendChild(el("div", "lycoris-rows-triggers", `trigger words: ${words.join(", ")}`));
        }
        return box;
    }

    /** The report's entries from lora_stack and lora_text (and rows no longer shown), below the rows. */
    othersElement(entries) {
        const box = el("div", "lycoris-rows-others");
        box.appendChild(el("div", "lycoris-chart-title", "also applied"));
        for (const entry of entries) {
            const from = entry.source === "row" ? `row ${entry.row}` : SOURCE_NAME[entry.source] ?? entry.source;
            const item = el("div", "lycoris-rows-other");
            item.dataset.source = String(entry.source);
            item.append(el("div", "lycoris-rows-other-name", `${entry.lora} (${from})`), this.reportElement([entry]));
            box.appendChild(item);
        }
        return box;
    }

    /** The editor's own textarea for the rows as text: kept across redraws, so typing in it keeps its focus. */
    textArea() {
        const area = el("textarea", "lycoris-rows-textarea");
        area.spellcheck = false;
        area.title = "The rows as saved and sent: a JSON list, one object per file";
        keepEvents(area);
        area.addEventListener("input", () => {
            this.setText(area.value, false);
            const { rows, error } = parseRows(area.value);
            this.rows = rows;
            this.error = error;
            this.render();
            area.focus();
        });
        area.addEventListener("change", () => this.markChanged(true));
        return area;
    }

    fillList(names) {
        names.then((list) => {
            if (!list) return;
            const known = JSON.stringify(this.listed);
            this.listed = list;
            if (known === JSON.stringify(list)) return;
            this.list.replaceChildren(...list.map((name) => Object.assign(el("option"), { value: name })));
            // The "not in the loras folder" hints follow the list, but a redraw would take the focus of a field.
            if (!this.root.contains(document.activeElement)) this.render();
        });
    }

    /** The wheel zooms the canvas, as over the rest of the node, unless it scrolls a part of the editor. */
    onWheel(e) {
        for (let node = e.target; node && node !== this.root.parentElement; node = node.parentElement) {
            if (node.scrollHeight > node.clientHeight + 1 && /auto|scroll/.test(getComputedStyle(node).overflowY)) return;
        }
        const canvas = app.canvas?.canvas;
        if (!canvas) return;
        e.preventDefault();
        e.stopPropagation();
        const { clientX, clientY, deltaX, deltaY, deltaMode, ctrlKey, metaKey, shiftKey } = e;
        canvas.dispatchEvent(new WheelEvent("wheel", { clientX, clientY, deltaX, deltaY, deltaMode, ctrlKey, metaKey, shiftKey }));
    }

    /** Natural height of the editor (content + padding); the last height seen while it is hidden. */
    measure() {
        const h = this.content.offsetHeight;
        if (h > 0) {
            const style = getComputedStyle(this.root);
            this.lastHeight = h + parseFloat(style.paddingTop) + parseFloat(style.paddingBottom);
        }
        return this.lastHeight;
    }

    /** Grow the node (classic renderer) when the rows no longer fit; never shrink what the user sized. */
    fitNode() {
        requestAnimationFrame(() => {
            const node = this.node;
            if (!node.graph || !node.computeSize) return;
            this.measure();
            const want = node.computeSize();
            if (node.size[1] < want[1]) node.setSize([node.size[0], want[1]]);
            node.setDirtyCanvas?.(true, true);
        });
    }
}

/** Chain `fn` after the node's own `name` method. */
function after(node, name, fn) {
    const own = node[name];
    node[name] = function (...args) {
        const result = own?.apply(this, args);
        fn(...args);
        return result;
    };
}

/** The rows editor on a node (once); the `rows` textarea hidden in both renderers, its value still saved and sent. */
export function addRowsEditor(node) {
    if (node.widgets?.some((w) => w.name === ROWS_EDITOR_WIDGET)) return node.lycorisRows;
    const editor = new RowsEditor(node);
    const textWidget = editor.textWidget();
    if (textWidget) {
        textWidget.hidden = true; // the classic canvas (LGraphNode.isWidgetVisible)
        textWidget.options ??= {};
        textWidget.options.hidden = true; // the Vue renderer
        // No room either: frontend 1.32's classic layout sizes hidden widgets too (computeSize wins over a DOM
        // widget's own layout size; a height of -4 is no height once the widget's 4 px gap is added).
        textWidget.computeSize = () => [0, -4];
    }
    const widget = node.addDOMWidget(ROWS_EDITOR_WIDGET, "lycoris_rows", editor.root, {
        serialize: false,
        hideOnZoom: false,
        getValue: () => undefined,
        setValue: () => {},
        getMinHeight: () => Math.max(editor.measure(), 40) + 2 * MARGIN,
        margin: MARGIN,
    });
    widget.serialize = false; // not in widgets_values, not sent with the prompt
    widget.serializeValue = () => undefined;
    node.lycorisRows = editor;
    after(node, "onRemoved", () => editor.dispose());
    after(node, "onConfigure", () => editor.load()); // a workflow opened, an undo: the saved text is in now
    // The clip strength shows while `clip` is linked.
    after(node, "onConnectionsChange", () => queueMicrotask(() => editor.render()));
    editor.load();
    return editor;
}

/** After a workflow is opened: each editor without a report shows its node's last kept run's, if any. */
export async function restoreRowsReports() {
    for (const editor of [...liveEditors]) await editor.restoreReport();
}
