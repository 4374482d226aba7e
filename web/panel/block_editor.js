// The per-block sliders of LyCORIS Loader (Block Weights): one per block the selected file touches, each rewriting the
// node's `block_weights` text as a named rule (lycoris_block_rules.js), which is what is saved and sent; the sliders
// themselves are not. Only exports: the frontend imports every file under web/.

import { app } from "../../../scripts/app.js";
import { blockWeight, formatWeight, parseBlockWeights, setBlockRule } from "../lycoris_block_rules.js";
import { el, keepEvents } from "./format.js";
import { BLOCK_WEIGHTS_WIDGET, CUSTOM_PRESET, PRESET_WIDGET } from "./names.js";
import { knownBlocks } from "./state.js";

const SLIDER = { min: -1, max: 2, step: 0.05 };

/** The range input's value for a weight: the weight, held within the slider's span. */
const sliderValue = (weight) => String(Math.min(SLIDER.max, Math.max(SLIDER.min, weight)));

/** The block editor of one panel (`panel`: its LycorisPanel, for the node, the selected file and its last report). */
export class BlockEditor {
    constructor(panel) {
        this.panel = panel;
        this.sliders = new Map(); // block name -> {range, number}, while the editor is shown
    }

    textWidget() {
        return this.panel.node.widgets?.find((w) => w.name === BLOCK_WEIGHTS_WIDGET);
    }

    /** The blocks the selected file touches: from this node's last run, else from any report for the same file. */
    blockNames() {
        const { report, reportName } = this.panel;
        const name = this.panel.currentName();
        const own = report && reportName === name && Array.isArray(report.blocks) ? report.blocks : [];
        const names = own.map((b) => b?.name).filter(Boolean);
        return names.length ? names : knownBlocks.get(name) ?? [];
    }

    /** The editor's part of the panel, drawn anew with each render of the panel. */
    render() {
        this.sliders.clear();
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
        const preset = this.panel.node.widgets?.find((w) => w.name === PRESET_WIDGET)?.value;
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
        range.value = sliderValue(weight);
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
        range.addEventListener("change", () => this.panel.markChanged(true));
        number.addEventListener("change", () => {
            const value = Number(number.value);
            if (number.value.trim() === "" || !isFinite(value)) {
                number.value = formatWeight(blockWeight(String(this.textWidget()?.value ?? ""), name));
                return;
            }
            range.value = sliderValue(value);
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
        const node = this.panel.node;
        const old = String(widget.value ?? "");
        const text = setBlockRule(old, name, value);
        if (text === old) return;
        widget.value = text;
        // The multiline widget's textarea, where the frontend does not sync it from the value itself (the classic
        // renderer; `element` in every frontend, `inputEl` is a deprecated name for it).
        const area = widget.element;
        if (area && "value" in area && area.value !== text) area.value = text;
        try {
            widget.callback?.(text, app.canvas, node, undefined, undefined);
            node.onWidgetChanged?.(widget.name, text, old, widget);
        } catch (e) {
            console.error("[lycoris_panel] block_weights callback:", e);
        }
        this.panel.markChanged(commit);
    }

    /** After the text was edited by hand: move the sliders to what it now says (no full redraw while dragging). */
    syncSliders() {
        if (!this.sliders.size) return;
        const parsed = parseBlockWeights(String(this.textWidget()?.value ?? ""));
        for (const [name, { range, number }] of this.sliders) {
            const weight = blockWeight(parsed, name);
            if (document.activeElement !== number) number.value = formatWeight(weight);
            if (document.activeElement !== range) range.value = sliderValue(weight);
        }
    }
}
