// The DOM widgets the extension adds to nodes: the panel ("lycoris_panel") and the tools' report ("lycoris_report"),
// both plain DOM (the classic canvas and the Vue renderer alike) and never serialized; and the hooks that let the
// panel follow the node's own widgets. Only exports: the frontend imports every file under web/.

import { el, keepEvents, stylesheet } from "./format.js";
import { dropInProgress } from "./model_drop.js";
import { NAME_WIDGET, PANEL_WIDGET, PRESET_WIDGET, REPORT_WIDGET } from "./names.js";
import { LycorisPanel } from "./panel.js";

const REPORT_IDLE = "Run to write the file; its report (form, rank and error per module) shows here.";
const MARGIN = 8; // px around the panel inside the node (the DOM widget default is 10)
const TEXT_MIN_HEIGHT = 130; // px: about eight block_weights rules in the classic renderer (its default is 50)

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
            const dropped = dropInProgress();
            if (v !== before) queueMicrotask(() => after(v, before, dropped));
        },
    });
}

/** The panel on a node (once), following its file combo and, on Block Weights, its block_weights text and preset. */
export function addPanel(node) {
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
    const editor = panel.blockEditor;
    if (editor) {
        // Sliders follow the text when it is typed (the textarea's input event) or set (its callback, the preset).
        const textWidget = editor.textWidget();
        // Room for the rules in the classic renderer (the Vue renderer's textarea gets it from lycoris_panel.css).
        if (textWidget?.options && !textWidget.options.getMinHeight) textWidget.options.getMinHeight = () => TEXT_MIN_HEIGHT;
        const area = textWidget?.element;
        area?.addEventListener?.("input", () => editor.syncSliders());
        afterCallback(textWidget, () => editor.syncSliders());
        afterCallback(node.widgets?.find((w) => w.name === PRESET_WIDGET), () => panel.render());
    }
    // After the graph's configure() has set the saved widget values (a no-op if loadedGraphNode did it).
    setTimeout(() => panel.refresh(), 0);
    return panel;
}

/** The tool's report as plain text in a DOM widget (both renderers, like the panel); not serialized. */
export function addReport(node) {
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
