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

import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { blockWeight, formatWeight, parseBlockWeights, setBlockRule } from "./lycoris_block_rules.js";

const NODE_TYPES = ["LycorisLoader", "LycorisLoaderModelOnly", "LycorisInfo", "LycorisBlockWeights", "LycorisBlockInfo"];
const BLOCK_EDITOR_TYPES = ["LycorisBlockWeights"];
// The tools (Save, Resize, Extract, Convert LyCORIS): their report (the node's "text" UI output) shown on the node.
const TOOL_TYPES = ["LycorisSave", "LycorisResize", "LycorisExtract", "LycorisConvert"];
const REPORT_WIDGET = "lycoris_report";
const REPORT_IDLE = "Run to write the file; its report (form, rank and error per module) shows here.";
const PANEL_WIDGET = "lycoris_panel";
const NAME_WIDGET = "lycoris_name";
const BLOCK_WEIGHTS_WIDGET = "block_weights";
const PRESET_WIDGET = "preset";
const CUSTOM_PRESET = "custom";
const SLIDER = { min: -1, max: 2, step: 0.05 };
const MAX_PROBLEMS = 5;
const COPIED_MS = 1500;
const MARGIN = 8; // px around the panel inside the node (the DOM widget default is 10)
const TEXT_MIN_HEIGHT = 130; // px: about eight block_weights rules in the classic renderer (its default is 50)

const CSS_URL = new URL("./lycoris_panel.css", import.meta.url).href;
// Reports of earlier runs looked up for a node ComfyUI answered from its cache: the newest entries first, then more.
const HISTORY_PAGES = [32, 512];
const PROMPT_LOOKUPS = 20; // tries to read the cached run's own prompt (queue, then history), PROMPT_RETRY_MS apart
const PROMPT_RETRY_MS = 150;

/**
 * The panel's stylesheet, as a <link> inside the panel itself: nothing is added to document.head or document.body,
 * and the rules (all under .lycoris-*) apply while a panel is on the page. Every panel has one; the browser fetches
 * the file once.
 */
function stylesheet() {
    const link = document.createElement("link");
    link.rel = "stylesheet";
    link.href = CSS_URL;
    link.className = "lycoris-stylesheet";
    return link;
}

/** Run `after` each time the widget's value is set through its callback, keeping any callback it already has. */
function afterCallback(widget, after) {
    if (!widget) return;
    const callback = widget.callback;
    widget.callback = function (...args) {
        const result = callback?.apply(this, args);
        after();
        return result;
    };
}

function el(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined) node.textContent = text;
    return node;
}

function fmtNum(x) {
    if (typeof x !== "number" || !isFinite(x)) return String(x);
    if (Number.isInteger(x)) return String(x);
    return Math.abs(x) >= 0.1 ? x.toFixed(2) : x.toPrecision(2);
}

function fmtRange(range) {
    if (!range || range.min == null) return null;
    return range.min === range.max ? fmtNum(range.min) : `${fmtNum(range.min)}–${fmtNum(range.max)}`;
}

function fmtSize(bytes) {
    if (typeof bytes !== "number") return null;
    const units = ["B", "KB", "MB", "GB"];
    let i = 0;
    while (bytes >= 1024 && i < units.length - 1) {
        bytes /= 1024;
        i++;
    }
    return `${i ? bytes.toFixed(1) : bytes} ${units[i]}`;
}

function entries(obj) {
    return obj && typeof obj === "object" ? Object.entries(obj) : [];
}

// Block names per file from the last report that listed them (any node type), so a Block Weights node can offer
// sliders after a LyCORIS Block Info run for its file; and the live panels, to redraw those when one arrives.
const knownBlocks = new Map();
const livePanels = new Set();

/** A pointer or key event on a control is the control's, not a drag or shortcut of the node/canvas. */
function keepEvents(control) {
    for (const type of ["pointerdown", "mousedown", "dblclick", "keydown"]) {
        control.addEventListener(type, (e) => e.stopPropagation());
    }
}

/** Copy to the clipboard; the fallback's temporary textarea goes inside `container` (the panel), not the page. */
async function copyText(text, container) {
    try {
        await navigator.clipboard.writeText(text);
        return true;
    } catch {
        // Not a secure context, or clipboard permission denied: the old way.
        const area = el("textarea");
        area.value = text;
        area.setAttribute("readonly", "");
        area.style.cssText = "position:fixed;left:-9999px;top:0;opacity:0";
        container.appendChild(area);
        area.select();
        let ok = false;
        try {
            ok = document.execCommand("copy");
        } catch {
            ok = false;
        }
        area.remove();
        return ok;
    }
}

class LycorisPanel {
    constructor(node) {
        this.node = node;
        this.info = null; // GET /lycoris/info answer for this.infoName
        this.infoName = null;
        this.error = null; // text shown when the route failed
        this.loading = false;
        this.report = null; // the last run's report
        this.reportName = null; // the file it was for
        this.requestId = 0;
        this.lastHeight = 0;
        this.blockEditor = BLOCK_EDITOR_TYPES.includes(node.comfyClass);
        // A node with a block_weights textarea: the panel keeps its natural height and the textarea gets the rest.
        this.sharesSpace = !!node.widgets?.some((w) => w.name === BLOCK_WEIGHTS_WIDGET);
        this.lastWant = 0;
        this.sliders = new Map(); // block name -> {range, number}, while the editor is shown
        livePanels.add(this);

        this.root = el("div", "lycoris-panel");
        this.content = el("div", "lycoris-content"); // natural height, measured for the node's size
        this.root.append(stylesheet(), this.content);
        this.cached = null; // null, or how the last report came back for a run ComfyUI answered from its cache
        // Re-fit the node when the content is first laid out (mounting happens after render) or re-wraps.
        if (typeof ResizeObserver === "function") {
            this.observer = new ResizeObserver(() => {
                const before = this.lastHeight;
                if (this.measure() !== before) this.fitNode();
            });
            this.observer.observe(this.content);
        }
        this.root.addEventListener("wheel", (e) => this.onWheel(e), { passive: false });
        this.render();
    }

    /** The wheel zooms the canvas, as over the rest of the node, unless it scrolls a part of the panel. */
    onWheel(e) {
        for (let el = e.target; el && el !== this.root.parentElement; el = el.parentElement) {
            if (el.scrollHeight > el.clientHeight + 1 && /auto|scroll/.test(getComputedStyle(el).overflowY)) return;
        }
        const canvas = app.canvas?.canvas;
        if (!canvas) return;
        e.preventDefault();
        e.stopPropagation();
        const { clientX, clientY, deltaX, deltaY, deltaMode, ctrlKey, metaKey, shiftKey } = e;
        canvas.dispatchEvent(
            new WheelEvent("wheel", { clientX, clientY, deltaX, deltaY, deltaMode, ctrlKey, metaKey, shiftKey }),
        );
    }

    dispose() {
        this.observer?.disconnect();
        this.requestId++;
        livePanels.delete(this);
    }

    nameWidget() {
        return this.node.widgets?.find((w) => w.name === NAME_WIDGET);
    }

    currentName() {
        const value = this.nameWidget()?.value;
        return typeof value === "string" && value ? value : null;
    }

    /** False when the name is not among the files the combo lists (a template's placeholder, a file since removed):
     * the server would answer 404, so nothing is asked. Names saved on Windows (`sub\\file`) are listed with `/`. */
    isListed(name) {
        const values = this.nameWidget()?.options?.values;
        if (!Array.isArray(values)) return true; // a frontend that lists them elsewhere: the route decides
        return values.includes(name) || values.includes(name.replaceAll("\\", "/"));
    }

    /** Fetch the metadata of the selected file unless it is already shown (or being fetched). */
    async refresh(force = false) {
        const name = this.currentName();
        if (!name) {
            this.info = null;
            this.infoName = null;
            this.error = this.nameWidget() ? "no file selected" : null;
            this.render();
            return;
        }
        if (!force && name === this.infoName && (this.info || this.loading)) return;
        if (this.report && this.reportName !== name) {
            this.report = null; // the last run was another file
            this.cached = null;
        }
        const id = ++this.requestId;
        this.infoName = name;
        if (!this.isListed(name)) {
            this.loading = false;
            this.info = null;
            this.error = `${name} is not in the loras folder: pick one of your files (or press R after adding it)`;
            this.render();
            return;
        }
        this.loading = true;
        this.error = null;
        this.render();
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
        if (id !== this.requestId) return; // a newer request won
        this.loading = false;
        this.info = info;
        this.error = error;
        this.render();
    }

    /** A run's report (the node's "lycoris" UI output); `cached`: "restored" when it is an earlier run's. */
    onExecuted(output, cached = null) {
        const report = Array.isArray(output?.lycoris) ? output.lycoris[0] : output?.lycoris;
        if (!report || typeof report !== "object") return;
        this.cached = cached;
        this.report = report;
        this.reportName = report.summary?.name ?? this.currentName();
        const names = Array.isArray(report.blocks) ? report.blocks.map((b) => b?.name).filter(Boolean) : [];
        if (names.length && this.reportName) {
            knownBlocks.set(this.reportName, names);
            for (const panel of livePanels) {
                if (panel !== this && panel.blockEditor && panel.currentName() === this.reportName) panel.render();
            }
        }
        if (report.summary && typeof report.summary === "object") {
            this.info = report.summary;
            this.infoName = report.summary.name ?? this.currentName();
            this.error = null;
            this.loading = false;
            this.requestId++; // an older pending fetch must not overwrite this
        }
        this.render();
    }

    /** ComfyUI answered this node from its cache: it did not run and sent no report; its last one is looked up. */
    onCachedStart() {
        this.cached = "looking";
        this.render();
    }

    /** The report of the run whose output ComfyUI reused (null: not in the server's history any more). */
    onCached(report) {
        if (report) {
            this.onExecuted({ lycoris: [report] }, "restored");
            return;
        }
        // The report this panel already shows is that run's when it is for the same file.
        this.cached = this.report && this.reportName === this.currentName() ? "kept" : "missing";
        this.render();
    }

    cacheNote() {
        if (this.cached === "looking") return "ComfyUI answered this node from its cache: looking up its last report…";
        if (this.cached === "missing") {
            return "ComfyUI answered this node from its cache, and the report of the run that made it is no longer in "
                + "the server's history: change an input to run it again";
        }
        if (this.cached === "reloaded") return "the last run's report, from the server's history";
        if (this.cached) return "from ComfyUI's cache: the node did not run again, this is its last run's report";
        return null;
    }

    render() {
        try {
            this.content.replaceChildren(...this.sections());
        } catch (e) {
            // Never break the node: show what went wrong instead.
            this.content.replaceChildren(el("div", "lycoris-status lycoris-error", `panel error: ${e?.message || e}`));
        }
        this.root.dataset.nodeId = String(this.node.id);
        this.fitNode();
    }

    sections() {
        const out = [];
        const info = this.info;
        if (info) out.push(this.header(info));
        if (this.loading && !info) out.push(el("div", "lycoris-status", "loading metadata…"));
        if (this.error) out.push(el("div", "lycoris-status lycoris-error", this.error));
        if (info?.trigger_words?.length) out.push(this.triggers(info.trigger_words));
        const report = this.report;
        const cacheNote = this.cacheNote();
        if (report && (report.line || report.total != null)) {
            out.push(this.coverage(report));
            if (cacheNote) out.push(el("div", "lycoris-note lycoris-cached", cacheNote));
            if (report.blocks?.length) out.push(this.chart(report.blocks));
            else if (report.blocks === null && report.applied > 0) {
                const note = `per-block change not measured here (${report.not_measured || "large file"}): see LyCORIS Info`;
                out.push(el("div", "lycoris-note", note));
            }
        } else if (report) {
            // LyCORIS Info without a model or clip: what the file is, not what it does.
            out.push(el("div", "lycoris-coverage lycoris-idle", "connect a model or clip to see what it changes"));
        } else if (cacheNote) {
            out.push(el("div", "lycoris-coverage lycoris-idle lycoris-cached", cacheNote));
        } else if (info) {
            out.push(el("div", "lycoris-coverage lycoris-idle", "run the workflow to see what it changed"));
        }
        this.sliders.clear();
        if (this.blockEditor) out.push(this.blockSliders());
        return out;
    }

    // --- per-block sliders (LyCORIS Loader (Block Weights)) ---------------------------------------------------------

    textWidget() {
        return this.node.widgets?.find((w) => w.name === BLOCK_WEIGHTS_WIDGET);
    }

    /** The blocks the selected file touches: from this node's last run, else from any report for the same file. */
    blockNames() {
        const name = this.currentName();
        const own = this.report && this.reportName === name && Array.isArray(this.report.blocks) ? this.report.blocks : [];
        const names = own.map((b) => b?.name).filter(Boolean);
        return names.length ? names : knownBlocks.get(name) ?? [];
    }

    blockSliders() {
        const box = el("div", "lycoris-blocks");
        box.appendChild(el("div", "lycoris-chart-title", "block weights (rewrites block_weights)"));
        const widget = this.textWidget();
        const names = this.blockNames();
        if (!widget) {
            box.appendChild(el("div", "lycoris-note", `no ${BLOCK_WEIGHTS_WIDGET} widget on this node`));
            return box;
        }
        if (!names.length) {
            const hint = "run the workflow (or LyCORIS Block Info for this file) to get a slider per block";
            box.appendChild(el("div", "lycoris-note", hint));
            return box;
        }
        const text = String(widget.value ?? "");
        const parsed = parseBlockWeights(text);
        if (parsed.error) box.appendChild(el("div", "lycoris-status lycoris-error", `block_weights: ${parsed.error}`));
        const preset = this.node.widgets?.find((w) => w.name === PRESET_WIDGET)?.value;
        if (preset && preset !== CUSTOM_PRESET) {
            box.appendChild(el("div", "lycoris-note", `preset "${preset}" applies first; the sliders show these rules only`));
        }
        const list = el("div", "lycoris-sliders");
        for (const name of names) list.appendChild(this.sliderRow(name, blockWeight(parsed, name)));
        box.appendChild(list);
        return box;
    }

    sliderRow(name, weight) {
        const row = el("div", "lycoris-slider-row");
        row.dataset.block = name;
        const label = el("span", "lycoris-block-name", name);
        label.title = name;
        const range = el("input", "lycoris-slider");
        Object.assign(range, { type: "range", min: SLIDER.min, max: SLIDER.max, step: SLIDER.step });
        range.value = String(Math.min(SLIDER.max, Math.max(SLIDER.min, weight)));
        range.title = `${name}: block weight`;
        const number = el("input", "lycoris-slider-value");
        Object.assign(number, { type: "number", step: SLIDER.step });
        number.value = formatWeight(weight);
        number.title = `${name}: block weight (any number)`;
        keepEvents(range);
        keepEvents(number);
        // While dragging the text follows the slider; on release the edit becomes one undo step.
        range.addEventListener("input", () => {
            number.value = formatWeight(range.value);
            this.setBlock(name, Number(range.value), false);
        });
        range.addEventListener("change", () => this.markChanged(true));
        number.addEventListener("change", () => {
            const value = Number(number.value);
            if (number.value.trim() === "" || !isFinite(value)) {
                number.value = formatWeight(blockWeight(String(this.textWidget()?.value ?? ""), name));
                return;
            }
            range.value = String(Math.min(SLIDER.max, Math.max(SLIDER.min, value)));
            this.setBlock(name, value, true);
        });
        row.append(label, range, number);
        this.sliders.set(name, { range, number });
        return row;
    }

    /** Rewrite block_weights with `name=value` in effect, as if typed: the value, callbacks, and a modified graph. */
    setBlock(name, value, commit) {
        const widget = this.textWidget();
        if (!widget) return;
        const old = String(widget.value ?? "");
        const text = setBlockRule(old, name, value);
        if (text === old) return;
        widget.value = text;
        // The multiline widget's textarea, where the frontend does not sync it from the value itself (the classic
        // renderer; `element` in every frontend, `inputEl` is a deprecated name for it).
        const area = widget.element;
        if (area && "value" in area && area.value !== text) area.value = text;
        try {
            widget.callback?.(text, app.canvas, this.node, undefined, undefined);
            this.node.onWidgetChanged?.(widget.name, text, old, widget);
        } catch (e) {
            console.error("[lycoris_panel] block_weights callback:", e);
        }
        this.markChanged(commit);
    }

    /** The graph changed: redraw; with `commit`, also the workflow's "modified" mark and an undo step. */
    markChanged(commit) {
        const graph = this.node.graph ?? app.graph;
        graph?.change?.();
        this.node.setDirtyCanvas?.(true, true);
        app.canvas?.setDirty?.(true, true);
        if (commit) {
            // An undo step: captureCanvasState since frontend 1.58 (checkState, its old name, warns there).
            const tracker = app.extensionManager?.workflow?.activeWorkflow?.changeTracker;
            (tracker?.captureCanvasState ?? tracker?.checkState)?.call(tracker);
        }
    }

    /** After the text was edited by hand: move the sliders to what it now says (no full redraw while dragging). */
    syncSliders() {
        if (!this.sliders.size) return;
        const parsed = parseBlockWeights(String(this.textWidget()?.value ?? ""));
        for (const [name, { range, number }] of this.sliders) {
            const weight = blockWeight(parsed, name);
            if (document.activeElement !== number) number.value = formatWeight(weight);
            if (document.activeElement !== range) range.value = String(Math.min(SLIDER.max, Math.max(SLIDER.min, weight)));
        }
    }

    header(info) {
        const box = el("div", "lycoris-header");
        const title = el("div", "lycoris-title", info.title || info.name || this.infoName || "");
        title.title = info.name || "";
        box.appendChild(title);

        const algos = entries(info.algorithms).map(([algo, n]) => `${algo} ×${n}`);
        const algoLine = el("div", "lycoris-algos", algos.length ? algos.join(", ") : "no modules recognised");
        box.appendChild(algoLine);

        const facts = [];
        if (info.module_count != null) facts.push(`${info.module_count} modules`);
        const rank = fmtRange(info.rank);
        if (rank) facts.push(`rank ${rank}`);
        const convRank = fmtRange(info.conv_rank);
        if (convRank) facts.push(`conv rank ${convRank}`);
        if (info.tucker) facts.push("Tucker");
        const alpha = fmtRange(info.alpha);
        if (alpha) facts.push(`alpha ${alpha}`);
        if (info.dora_axis) facts.push(`DoRA ${info.dora_axis}`);
        const dtypes = entries(info.dtypes).map(([d]) => d);
        if (dtypes.length) facts.push(dtypes.join("/"));
        const size = fmtSize(info.size_bytes);
        if (size) facts.push(size);
        if (facts.length) box.appendChild(el("div", "lycoris-meta", facts.join(" · ")));

        const base = info.base_model || {};
        if (base.declared || base.inferred) {
            let text = `base: ${base.declared || base.inferred}`;
            if (!base.declared) text += " (from its keys)";
            else if (base.inferred && base.inferred !== base.declared) text += ` (declared), ${base.inferred} (from its keys)`;
            box.appendChild(el("div", "lycoris-base", text));
        }
        if (info.made_by?.line) box.appendChild(el("div", "lycoris-base", info.made_by.line));
        // Where the alpha above comes from (file, PEFT config, patterns), or what was assumed without one.
        if (info.alpha_from?.line) box.appendChild(el("div", "lycoris-base", info.alpha_from.line));
        for (const warning of info.warnings || []) box.appendChild(el("div", "lycoris-base", `warning: ${warning}`));
        const training = entries(info.training);
        if (training.length) {
            // Full training metadata as a tooltip: the panel stays small.
            box.title = training.map(([k, v]) => `${k}: ${v}`).join("\n");
        }
        return box;
    }

    triggers(words) {
        const box = el("div", "lycoris-triggers");
        const status = el("span", "lycoris-copied");
        for (const word of words) {
            const chip = el("button", "lycoris-trigger", word);
            chip.type = "button";
            chip.title = "copy to clipboard";
            // A chip is a button, not a handle to drag the node by.
            chip.addEventListener("pointerdown", (e) => e.stopPropagation());
            chip.addEventListener("click", async (e) => {
                e.stopPropagation();
                const ok = await copyText(word, this.root);
                status.textContent = ok ? "copied" : "copy failed";
                chip.classList.toggle("lycoris-done", ok);
                clearTimeout(this.copiedTimer);
                this.copiedTimer = setTimeout(() => {
                    status.textContent = "";
                    chip.classList.remove("lycoris-done");
                }, COPIED_MS);
            });
            box.appendChild(chip);
        }
        box.appendChild(status);
        return box;
    }

    coverage(report) {
        // Modules that did not fit, then file keys that belong to no module: [key, reason] pairs.
        const list = (x) => (Array.isArray(x) ? x : []);
        const problems = [...list(report.problems), ...list(report.unused_keys)];
        const nothing = report.applied === 0 && report.total > 0;
        const partial = problems.length > 0 || report.applied < report.total || !!report.verdict;
        // What the loader assumed or lost while applying (a merge re-rounding into quantized weights, an alpha
        // taken from the rank): shown under the line, and the box is amber.
        const warnings = list(report.warnings);
        const level = nothing ? "lycoris-error" : partial || warnings.length ? "lycoris-warn" : "lycoris-ok";
        const box = el("div", `lycoris-coverage ${level}`);
        box.appendChild(el("div", "lycoris-line", report.line || `${report.applied}/${report.total} modules applied`));
        if (warnings.length) {
            const items = el("ul", "lycoris-problems lycoris-warnings");
            for (const warning of warnings) {
                const item = el("li", null, String(warning));
                item.title = item.textContent;
                items.appendChild(item);
            }
            box.appendChild(items);
        }
        if (problems.length) {
            const items = el("ul", "lycoris-problems");
            for (const problem of problems.slice(0, MAX_PROBLEMS)) {
                const [key, reason] = Array.isArray(problem) ? problem : [problem, ""];
                const item = el("li", null, reason ? `${key}: ${reason}` : String(key));
                item.title = item.textContent;
                items.appendChild(item);
            }
            if (problems.length > MAX_PROBLEMS) {
                items.appendChild(el("li", "lycoris-more", `… and ${problems.length - MAX_PROBLEMS} more`));
            }
            box.appendChild(items);
        }
        return box;
    }

    chart(blocks) {
        const box = el("div", "lycoris-chart");
        box.appendChild(el("div", "lycoris-chart-title", "change per block (‖ΔW‖/‖W‖)"));
        const size = (b) => (typeof b.change === "number" && isFinite(b.change) ? Math.abs(b.change) : 0);
        const max = Math.max(...blocks.map(size));
        for (const block of blocks) {
            const change = size(block);
            const row = el("div", "lycoris-row");
            row.title = `${block.name}: ${fmtNum(block.change)}`;
            if (block.modules != null) row.title += ` (${block.modules} modules)`;
            row.appendChild(el("span", "lycoris-block-name", block.name));
            const track = el("span", "lycoris-track");
            const bar = el("span", "lycoris-bar");
            bar.style.width = `${max > 0 ? Math.max(1, (100 * change) / max) : 0}%`;
            track.appendChild(bar);
            row.appendChild(track);
            row.appendChild(el("span", "lycoris-value", fmtNum(block.change)));
            box.appendChild(row);
        }
        return box;
    }

    /** Natural height of the panel (content + padding); 0 until first laid out, then the last height seen (hidden). */
    measure() {
        const h = this.content.offsetHeight;
        if (h > 0) {
            const style = getComputedStyle(this.root);
            this.lastHeight = h + parseFloat(style.paddingTop) + parseFloat(style.paddingBottom);
        }
        return this.lastHeight;
    }

    /**
     * Grow the node (classic renderer) when the content no longer fits; never shrink what the user sized. Next to a
     * textarea, the room the node had beyond its minimum stays the textarea's when the panel grows.
     */
    fitNode() {
        requestAnimationFrame(() => {
            const node = this.node;
            if (!node.graph || !node.computeSize) return;
            this.measure();
            const want = node.computeSize();
            const spare = this.sharesSpace && this.lastWant ? Math.max(0, node.size[1] - this.lastWant) : 0;
            this.lastWant = want[1];
            if (node.size[1] < want[1] + spare) node.setSize([node.size[0], want[1] + spare]);
            node.setDirtyCanvas?.(true, true);
        });
    }
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

async function restoreCached(detail) {
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
async function restoreFromHistory() {
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

function addPanel(node) {
    if (node.widgets?.some((w) => w.name === PANEL_WIDGET)) return node.lycorisPanel;
    const panel = new LycorisPanel(node);
    const widget = node.addDOMWidget(PANEL_WIDGET, "lycoris_panel", panel.root, {
        serialize: false,
        hideOnZoom: false,
        getValue: () => undefined,
        setValue: () => {},
        // The panel's natural height (a fallback before it is first laid out) plus the widget's margins.
        getMinHeight: () => Math.max(panel.measure(), 40) + 2 * MARGIN,
        // Beside a textarea the panel takes no more than it needs, so extra node height goes to the text.
        ...(panel.sharesSpace ? { getMaxHeight: () => Math.max(panel.measure(), 40) + 2 * MARGIN } : {}),
        margin: MARGIN,
    });
    widget.serialize = false; // not in widgets_values, not sent with the prompt
    widget.serializeValue = () => undefined;
    node.lycorisPanel = panel;
    const onRemoved = node.onRemoved;
    node.onRemoved = function (...args) {
        panel.dispose();
        return onRemoved?.apply(this, args);
    };

    afterCallback(panel.nameWidget(), () => panel.refresh());
    // A model-library drop calls no callback: the panel follows, and the node hears of the change as from a user
    // (frontend 1.58 clears its "missing model" mark of the node there), and the workflow is marked modified.
    afterAssign(panel.nameWidget(), (value, before, dropped) => {
        if (dropped) {
            node.onWidgetChanged?.(NAME_WIDGET, value, before, panel.nameWidget());
            panel.markChanged(true);
        }
        panel.refresh();
    });
    if (panel.blockEditor) {
        // Sliders follow the text when it is typed (the textarea's input event) or set (its callback, the preset).
        const textWidget = panel.textWidget();
        // Room for the rules in the classic renderer (the Vue renderer's textarea gets it from lycoris_panel.css).
        if (textWidget?.options && !textWidget.options.getMinHeight) textWidget.options.getMinHeight = () => TEXT_MIN_HEIGHT;
        const area = textWidget?.element;
        area?.addEventListener?.("input", () => panel.syncSliders());
        afterCallback(textWidget, () => panel.syncSliders());
        afterCallback(node.widgets?.find((w) => w.name === PRESET_WIDGET), () => panel.render());
    }
    // After the graph's configure() has set the saved widget values (a no-op if loadedGraphNode did it).
    setTimeout(() => panel.refresh(), 0);
    return panel;
}

/** The tool's report as plain text in a DOM widget (both renderers, like the panel); not serialized. */
function addReport(node) {
    if (node.widgets?.some((w) => w.name === REPORT_WIDGET)) return node.lycorisReport;
    const root = el("div", "lycoris-panel lycoris-report");
    root.appendChild(stylesheet());
    const text = el("pre", "lycoris-report-text lycoris-idle", REPORT_IDLE);
    root.appendChild(text);
    keepEvents(text); // selecting the text is not a drag of the node
    const widget = node.addDOMWidget(REPORT_WIDGET, "lycoris_report", root, {
        serialize: false,
        hideOnZoom: false,
        getValue: () => undefined,
        setValue: () => {},
        getMinHeight: () => 60 + 2 * MARGIN,
        margin: MARGIN,
    });
    widget.serialize = false;
    widget.serializeValue = () => undefined;
    const report = {
        root,
        show(output) {
            const lines = output?.text;
            if (!Array.isArray(lines) || !lines.length) return;
            text.textContent = lines.join("\n");
            text.className = "lycoris-report-text";
            node.setDirtyCanvas?.(true, true);
        },
    };
    node.lycorisReport = report;
    return report;
}

// --- LoRAs dropped from the model library --------------------------------------------------------------------------
//
// The frontend (1.32 to 1.58) decides what a model dropped from its model library does with a table from model folder
// to (node type, widget name): dropped onto a node listed there, the node's widget takes the file; dropped on empty
// canvas, the first entry's node is made. Node packs have no public way to add to the table: it is the Pinia store
// "modelToNode", reached here through the Vue app, behind feature detection. Without it (another frontend, the store
// renamed) nothing changes: a drop makes ComfyUI's own Load LoRA, as without this pack.

const DROP_FOLDER = "loras";
const DROP_SETTING = "LycorisNodes.ModelLibrary.DropOnCanvas";
const DROP_CORE = "ComfyUI's Load LoRA";
const DROP_OURS = "LyCORIS Loader";
const FIRST_DROP_TYPE = "LycorisLoader"; // made by an empty-canvas drop when the setting says so
const dropTypes = []; // the pack's node types with a lycoris_name file combo, from their definitions

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
function registerModelDrops(choice = app.extensionManager?.setting?.get?.(DROP_SETTING)) {
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

function watchDrags() {
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

/**
 * Call `after(value, before, dropped)` whenever the widget's value is assigned: a model-library drop sets it without
 * its callback (dropped: during a drop's dispatch).
 */
function afterAssign(widget, after) {
    if (!widget) return;
    let proto = widget;
    let desc;
    while (proto && !(desc = Object.getOwnPropertyDescriptor(proto, "value"))) proto = Object.getPrototypeOf(proto);
    if (desc && !desc.configurable && proto === widget) return;
    let plain = desc && "value" in desc ? desc.value : undefined;
    Object.defineProperty(widget, "value", {
        configurable: true,
        enumerable: true,
        get() {
            return desc?.get ? desc.get.call(this) : plain;
        },
        set(v) {
            const before = desc?.get ? desc.get.call(this) : plain;
            if (desc?.set) desc.set.call(this, v);
            else plain = v;
            const dropped = dropping;
            if (v !== before) queueMicrotask(() => after(v, before, dropped));
        },
    });
}

// --- Exact everywhere ------------------------------------------------------------------------------------------------
//
// The server reads this setting (nodes/glue/everywhere.py) each time ComfyUI loads a LoRA. ComfyUI keeps each node's
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

const extension = {
    name: "lycoris_nodes.panel",

    settings: [
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
    ],

    setup() {
        api.addEventListener("execution_cached", ({ detail }) => {
            restoreCached(detail).catch((e) => console.error("[lycoris_panel] execution_cached:", e));
        });
        watchDrags();
        registerModelDrops(); // last: a store of another shape that throws must not cost the rest of the set-up
    },

    async beforeRegisterNodeDef(nodeType, nodeData) {
        const fileInput = nodeData.input?.required?.[NAME_WIDGET];
        if (Array.isArray(fileInput) && !dropTypes.includes(nodeData.name)) dropTypes.push(nodeData.name);
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
