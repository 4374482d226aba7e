// Small DOM and number-formatting helpers of the panel and the tools' report. Only exports: the frontend imports
// every file under web/.

// This file is web/panel/format.js; the stylesheet stays web/lycoris_panel.css.
const CSS_URL = new URL("../lycoris_panel.css", import.meta.url).href;

/**
 * The panel's stylesheet, as a <link> inside the panel itself: nothing is added to document.head or document.body,
 * and the rules (all under .lycoris-*) apply while a panel is on the page. Every panel has one; the browser fetches
 * the file once.
 */
export function stylesheet() {
    const link = document.createElement("link");
    link.rel = "stylesheet";
    link.href = CSS_URL;
    link.className = "lycoris-stylesheet";
    return link;
}

export function el(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined) node.textContent = text;
    return node;
}

export function fmtNum(x) {
    if (typeof x !== "number" || !isFinite(x)) return String(x);
    if (Number.isInteger(x)) return String(x);
    return Math.abs(x) >= 0.1 ? x.toFixed(2) : x.toPrecision(2);
}

export function fmtRange(range) {
    if (!range || range.min == null) return null;
    return range.min === range.max ? fmtNum(range.min) : `${fmtNum(range.min)}–${fmtNum(range.max)}`;
}

export function fmtSize(bytes) {
    if (typeof bytes !== "number") return null;
    const units = ["B", "KB", "MB", "GB"];
    let i = 0;
    while (bytes >= 1024 && i < units.length - 1) {
        bytes /= 1024;
        i++;
    }
    return `${i ? bytes.toFixed(1) : bytes} ${units[i]}`;
}

export function entries(obj) {
    return obj && typeof obj === "object" ? Object.entries(obj) : [];
}

/** A pointer or key event on a control is the control's, not a drag or shortcut of the node/canvas. */
export function keepEvents(control) {
    for (const type of ["pointerdown", "mousedown", "dblclick", "keydown"]) {
        control.addEventListener(type, (e) => e.stopPropagation());
    }
}

/** Copy to the clipboard; the fallback's temporary textarea goes inside `container` (the panel), not the page. */
export async function copyText(text, container) {
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
