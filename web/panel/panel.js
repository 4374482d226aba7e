// The LycorisPanel class: one per node with the panel, holding what it shows (the file's metadata, the last run's
// report) and keeping the node sized to it. What it draws is in view.js, the block sliders in block_editor.js. Only
// exports: the frontend imports every file under web/.

import { app } from "../../../scripts/app.js";
import { BlockEditor } from "./block_editor.js";
import { fetchInfo } from "./fetching.js";
import { el, stylesheet } from "./format.js";
import { BLOCK_EDITOR_TYPES, BLOCK_WEIGHTS_WIDGET, NAME_WIDGET } from "./names.js";
import { knownBlocks, livePanels } from "./state.js";
import { sections } from "./view.js";

export class LycorisPanel {
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
        // The sliders of LyCORIS Loader (Block Weights), or null on the other node types.
        this.blockEditor = BLOCK_EDITOR_TYPES.includes(node.comfyClass) ? new BlockEditor(this) : null;
        // A node with a block_weights textarea: the panel keeps its natural height and the textarea gets the rest.
        this.sharesSpace = !!node.widgets?.some((w) => w.name === BLOCK_WEIGHTS_WIDGET);
        this.lastWant = 0;
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
        const { info, error } = await fetchInfo(name);
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

    render() {
        try {
            this.content.replaceChildren(...sections(this));
        } catch (e) {
            // Never break the node: show what went wrong instead.
            this.content.replaceChildren(el("div", "lycoris-status lycoris-error", `panel error: ${e?.message || e}`));
        }
        this.root.dataset.nodeId = String(this.node.id);
        this.fitNode();
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
