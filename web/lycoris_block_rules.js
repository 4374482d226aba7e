// Block weight text, as lycoris_core/block_weights.py reads it, for the panel's per-block sliders.
//
//   default=1; input_blocks.4-8=0.5; output_blocks.*=0; te=0.8
//
// Rules are separated by ";" or new lines, "#" starts a comment, "default" is the weight of every block no rule names,
// "*" matches one part of a name, "a-b" an index range, the last matching rule wins; a line of numbers is an
// A1111/Inspire LBW vector. Pure functions (no DOM, no ComfyUI imports), so Node can test them as they are.

const TE = "te";
const inBlocks = (...ids) => ids.map((i) => `input_blocks.${i}`);
const outBlocks = (...ids) => ids.map((i) => `output_blocks.${i}`);
const range = (n) => [...Array(n).keys()];

// The block each position of an LBW vector stands for (lycoris_core/block_weights.py LBW_LAYOUTS).
export const LBW_LAYOUTS = {
    17: [TE, ...inBlocks(1, 2, 4, 5, 7, 8), "middle_block", ...outBlocks(3, 4, 5, 6, 7, 8, 9, 10, 11)],
    26: [TE, ...inBlocks(...range(12)), "middle_block", ...outBlocks(...range(12))],
    12: [TE, ...inBlocks(4, 5, 7, 8), "middle_block", ...outBlocks(0, 1, 2, 3, 4, 5)],
    20: [TE, ...inBlocks(...range(9)), "middle_block", ...outBlocks(...range(9))],
};

const NUMBER = /^[+-]?(\d+\.?\d*|\.\d+)(e[+-]?\d+)?$/i;

function componentMatches(pattern, component) {
    if (pattern === "*" || pattern === component) return true;
    const span = /^(\d+)-(\d+)$/.exec(pattern);
    return !!span && /^\d+$/.test(component) && +span[1] <= +component && +component <= +span[2];
}

/** Does a rule pattern (["output_blocks", "*"]) match a path (["output_blocks", "1", ...])? Prefix match. */
export function patternMatches(pattern, path) {
    return path.length >= pattern.length && pattern.every((p, i) => componentMatches(p, path[i]));
}

/**
 * {rules: [{pattern, weight}], default, error}. A text the server would refuse gets `error` (a sentence) and the
 * rules read so far.
 */
export function parseBlockWeights(text) {
    const rules = [];
    let fallback = 1;
    const entries = String(text ?? "")
        .replace(/;/g, "\n")
        .split("\n")
        .map((line) => line.split("#", 1)[0].trim())
        .filter(Boolean);
    for (const entry of entries) {
        if (!entry.includes("=")) {
            const values = entry.split(",").map((v) => v.trim()).filter(Boolean);
            const layout = LBW_LAYOUTS[values.length];
            if (!layout) return { rules, default: fallback, error: `a vector of ${values.length} numbers is no LBW vector` };
            if (!values.every((v) => NUMBER.test(v))) return { rules, default: fallback, error: `'${entry}' is not numbers` };
            layout.forEach((block, i) => rules.push({ pattern: block.split("."), weight: Number(values[i]) }));
            continue;
        }
        const eq = entry.indexOf("=");
        const name = entry.slice(0, eq).trim();
        const value = entry.slice(eq + 1).trim();
        if (!name) return { rules, default: fallback, error: `'${entry}' is not 'block=weight'` };
        if (!NUMBER.test(value)) return { rules, default: fallback, error: `'${value}' is not a number` };
        if (name === "default") fallback = Number(value);
        else rules.push({ pattern: name.split("."), weight: Number(value) });
    }
    return { rules, default: fallback, error: null };
}

/** The weight the text gives a block (by its name, e.g. "input_blocks.4"): the last matching rule, else default. */
export function blockWeight(text, block) {
    const parsed = typeof text === "string" ? parseBlockWeights(text) : text;
    const path = block.split(".");
    let weight = parsed.default;
    for (const rule of parsed.rules) if (patternMatches(rule.pattern, path)) weight = rule.weight;
    return weight;
}

/** A weight as the sliders write it: at most 2 decimals, no trailing zeros ("0.5", "1", "-0.25"). */
export function formatWeight(value) {
    const rounded = Math.round(Number(value) * 100) / 100;
    return String(Object.is(rounded, -0) ? 0 : rounded);
}

/** The text split into lines, each into its rule segments (";"-separated, before any "#"). */
function segments(text) {
    const lines = text.split("\n").map((line) => {
        const hash = line.indexOf("#");
        const code = hash < 0 ? line : line.slice(0, hash);
        return { code: code.split(";"), comment: hash < 0 ? "" : line.slice(hash) };
    });
    const list = [];
    lines.forEach((line, li) =>
        line.code.forEach((seg, si) => {
            if (!seg.trim()) return;
            const eq = seg.indexOf("=");
            list.push({ li, si, name: eq < 0 ? null : seg.slice(0, eq).trim(), vector: eq < 0 ? seg.trim() : null });
        }),
    );
    return { lines, list };
}

function segmentMatches(seg, path) {
    if (seg.name !== null) return seg.name !== "default" && patternMatches(seg.name.split("."), path);
    const layout = LBW_LAYOUTS[seg.vector.split(",").filter((v) => v.trim()).length] ?? [];
    return layout.some((block) => patternMatches(block.split("."), path));
}

function join(lines) {
    return lines
        .filter((line) => !line.removed)
        .map((line) => line.code.join(";") + line.comment)
        .join("\n");
}

/**
 * The text with `block=value` in effect: the block's own rule gets the new value where it stands, unless a later rule
 * also matches the block (it would win), in which case the block's rules move to the end. Without a rule of its own,
 * one is added at the end (on a new line, or after "; " in a one-line text). Everything else (default=…, other rules,
 * comments, LBW vectors) is kept as written.
 */
export function setBlockRule(text, block, value) {
    text = String(text ?? "");
    const rule = `${block}=${formatWeight(value)}`;
    const written = text.replace(/\s+$/, "");
    const oneLine = !written.includes("\n") && written.includes(";"); // then a new rule goes after "; "
    const { lines, list } = segments(text);
    const path = block.split(".");
    const own = list.filter((seg) => seg.name === block);
    const last = own[own.length - 1];
    if (last) {
        const after = list.slice(list.indexOf(last) + 1);
        if (!after.some((seg) => segmentMatches(seg, path))) {
            const line = lines[last.li];
            const seg = line.code[last.si];
            const eq = seg.indexOf("=");
            const tail = seg.slice(eq + 1);
            const lead = /^\s*/.exec(tail)[0];
            const trail = /\s*$/.exec(tail)[0];
            line.code[last.si] = `${seg.slice(0, eq + 1)}${lead}${formatWeight(value)}${trail}`;
            return join(lines);
        }
        for (const seg of own) lines[seg.li].code[seg.si] = null;
        for (const line of lines) {
            if (!line.code.includes(null)) continue;
            line.code = line.code.filter((seg) => seg !== null);
            if (line.code.length) line.code[0] = line.code[0].replace(/^\s+/, "");
            if (!line.code.join("").trim() && !line.comment) line.removed = true;
        }
        text = join(lines);
    }
    const body = text.replace(/\s+$/, "");
    if (!body) return rule;
    const trailing = text.slice(body.length).includes("\n") ? "\n" : "";
    return `${body}${oneLine ? "; " : "\n"}${rule}${trailing}`;
}
