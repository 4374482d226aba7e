// What the panel shows, built as DOM from its state: the file's metadata (header, trigger chips), the last run's
// coverage and per-block chart, and the notes for a cached run. Only exports: the frontend imports every file under
// web/.

import { copyText, el, entries, fmtNum, fmtRange, fmtSize } from "./format.js";

const MAX_PROBLEMS = 5;
const COPIED_MS = 1500;

/** The panel's content, in order; the block editor's part (LyCORIS Loader (Block Weights)) last. */
export function sections(panel) {
    const out = [];
    const info = panel.info;
    if (info) out.push(header(info, panel.infoName));
    if (panel.loading && !info) out.push(el("div", "lycoris-status", "loading metadata…"));
    if (panel.error) out.push(el("div", "lycoris-status lycoris-error", panel.error));
    if (info?.trigger_words?.length) out.push(triggers(info.trigger_words, panel));
    const report = panel.report;
    const note = cacheNote(panel.cached);
    if (report && (report.line || report.total != null)) {
        out.push(coverage(report));
        if (note) out.push(el("div", "lycoris-note lycoris-cached", note));
        if (report.blocks?.length) out.push(chart(report.blocks));
        else if (report.blocks === null && report.applied > 0) {
            const text = `per-block change not measured here (${report.not_measured || "large file"}): see LyCORIS Info`;
            out.push(el("div", "lycoris-note", text));
        }
    } else if (report) {
        // LyCORIS Info without a model or clip: what the file is, not what it does.
        out.push(el("div", "lycoris-coverage lycoris-idle", "connect a model or clip to see what it changes"));
    } else if (note) {
        out.push(el("div", "lycoris-coverage lycoris-idle lycoris-cached", note));
    } else if (info) {
        out.push(el("div", "lycoris-coverage lycoris-idle", "run the workflow to see what it changed"));
    }
    if (panel.blockEditor) out.push(panel.blockEditor.render());
    return out;
}

/** How the report came back for a run ComfyUI answered from its cache (`cached`, see LycorisPanel), or null. */
function cacheNote(cached) {
    if (cached === "looking") return "ComfyUI answered this node from its cache: looking up its last report…";
    if (cached === "missing") {
        return "ComfyUI answered this node from its cache, and the report of the run that made it is no longer in "
            + "the server's history: change an input to run it again";
    }
    if (cached === "reloaded") return "the last run's report, from the server's history";
    if (cached) return "from ComfyUI's cache: the node did not run again, this is its last run's report";
    return null;
}

/** The file's metadata; `infoName`: the selected name, the title when the metadata has none. */
function header(info, infoName) {
    const box = el("div", "lycoris-header");
    const title = el("div", "lycoris-title", info.title || info.name || infoName || "");
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
    // What the file holds beside its modules (module configs): read and reported, no miss.
    for (const note of info.notes || []) box.appendChild(el("div", "lycoris-base", `note: ${note}`));
    const training = entries(info.training);
    if (training.length) {
        // Full training metadata as a tooltip: the panel stays small.
        box.title = training.map(([k, v]) => `${k}: ${v}`).join("\n");
    }
    return box;
}

/**
 * Trigger words as chips that copy on click. The panel holds the clipboard fallback's textarea and the one timer
 * that clears "copied", kept across redraws so a newer click's note is not cut short by an older one's.
 */
function triggers(words, panel) {
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
            const ok = await copyText(word, panel.root);
            status.textContent = ok ? "copied" : "copy failed";
            chip.classList.toggle("lycoris-done", ok);
            clearTimeout(panel.copiedTimer);
            panel.copiedTimer = setTimeout(() => {
                status.textContent = "";
                chip.classList.remove("lycoris-done");
            }, COPIED_MS);
        });
        box.appendChild(chip);
    }
    box.appendChild(status);
    return box;
}

/**
 * The last run's coverage line, with what the loader warned about, the first problems, then the first modules this
 * model lacks by design (harmless: in the neutral colour, and no reason for amber on their own).
 */
function coverage(report) {
    // Modules that did not fit, then file keys that belong to no module: [key, reason] pairs.
    const list = (x) => (Array.isArray(x) ? x : []);
    const problems = [...list(report.problems), ...list(report.unused_keys)];
    const harmless = list(report.harmless);
    const nothing = report.applied === 0 && report.total > 0;
    const partial = problems.length > 0 || report.applied + harmless.length < report.total || !!report.verdict;
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
    if (problems.length) box.appendChild(pairs(problems, "lycoris-problems"));
    if (harmless.length) box.appendChild(pairs(harmless, "lycoris-problems lycoris-harmless"));
    return box;
}

/** The first [key, reason] pairs as a list, then "… and N more". */
function pairs(rows, className) {
    const items = el("ul", className);
    for (const row of rows.slice(0, MAX_PROBLEMS)) {
        const [key, reason] = Array.isArray(row) ? row : [row, ""];
        const item = el("li", null, reason ? `${key}: ${reason}` : String(key));
        item.title = item.textContent;
        items.appendChild(item);
    }
    if (rows.length > MAX_PROBLEMS) items.appendChild(el("li", "lycoris-more", `… and ${rows.length - MAX_PROBLEMS} more`));
    return items;
}

/** The change per block of the last run, as bars scaled to the largest. */
function chart(blocks) {
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
