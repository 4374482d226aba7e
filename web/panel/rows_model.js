// The rows of LyCORIS Loader (Rows) and (Wan 2.2 Experts) as the `rows` widget holds them (issue #36): one JSON
// list, one object per file, in apply order (nodes/loading/rows.py says what each field means and refuses anything
// else). Pure functions, no DOM and no ComfyUI imports, so Node can test them as they are
// (tests/browser/rows_editor.test.mjs). Only exports: the frontend imports every file under web/.

export const EXPERT_CHOICES = ["auto", "both", "high", "low"];
const FIELDS = ["on", "lora", "strength", "strength_clip", "strength_low", "expert", "block_weights"];
const OPTIONAL_NUMBERS = ["strength_clip", "strength_low"];

/** A number as Python's repr() writes a float (what rows.py's json.dumps writes): 1.0, 0.8, 1e-05, 1e+16. */
export function pyFloat(x) {
    if (Object.is(x, -0)) return "-0.0";
    const [mantissa, exp] = x.toExponential().split("e"); // the shortest digits that read back as x, as Python's
    const e = Number(exp);
    if (e < -4 || e >= 16) return `${mantissa}e${e < 0 ? "-" : "+"}${String(Math.abs(e)).padStart(2, "0")}`;
    const text = String(x); // fixed notation in this range, as JS writes it
    return text.includes(".") ? text : `${text}.0`;
}

/** One JSON value as Python's json.dumps(ensure_ascii=False) writes it (strings and booleans are the same in JS). */
function pyJson(value) {
    return typeof value === "number" ? pyFloat(value) : JSON.stringify(value);
}

/** A row as rows.py's Row.to_json() writes it: on, lora, strength, then only what is set, expert unless "auto". */
function rowText(row) {
    const parts = [["on", row.on], ["lora", row.lora], ["strength", row.strength]];
    for (const key of [...OPTIONAL_NUMBERS, "block_weights"]) {
        if (row[key] != null && row[key] !== "") parts.push([key, row[key]]);
    }
    if (row.expert && row.expert !== "auto") parts.push(["expert", row.expert]);
    return `{${parts.map(([k, v]) => `${JSON.stringify(k)}: ${pyJson(v)}`).join(", ")}}`;
}

/** The `rows` value for these rows, character for character what rows.py's rows_text() writes for them. */
export function rowsText(rows) {
    return `[${rows.map(rowText).join(", ")}]`;
}

const isNumber = (v) => typeof v === "number" && isFinite(v);

/** One raw row checked as rows.py's _row() checks it (but an empty `lora` is a row whose file is still to pick). */
function checkRow(raw, number) {
    const where = `row ${number}`;
    if (!raw || typeof raw !== "object" || Array.isArray(raw)) return `${where} must be an object like {"lora": "name.safetensors", "strength": 1}`;
    const unknown = Object.keys(raw).filter((k) => !FIELDS.includes(k)).sort();
    if (unknown.length) return `${where} has ${unknown.map((k) => `'${k}'`).join(", ")}, which no row takes (a row takes ${[...FIELDS].sort().join(", ")})`;
    if (typeof (raw.lora ?? "") !== "string") return `${where}: 'lora' must be a file name`;
    if ("on" in raw && typeof raw.on !== "boolean") return `${where}: 'on' must be true or false`;
    if ("expert" in raw && !EXPERT_CHOICES.includes(raw.expert)) return `${where}: 'expert' must be one of ${EXPERT_CHOICES.join(", ")}`;
    if (raw.block_weights != null && typeof raw.block_weights !== "string") return `${where}: 'block_weights' must be text`;
    if ("strength" in raw && !isNumber(raw.strength)) return `${where}: 'strength' must be a finite number`;
    for (const key of OPTIONAL_NUMBERS) {
        if (raw[key] != null && !isNumber(raw[key])) return `${where}: '${key}' must be a finite number`;
    }
    return null;
}

/** A checked raw row with rows.py's defaults filled in. */
function normalRow(raw) {
    const row = { on: raw.on ?? true, lora: raw.lora ?? "", strength: raw.strength ?? 1 };
    for (const key of OPTIONAL_NUMBERS) if (raw[key] != null) row[key] = raw[key];
    if (raw.block_weights) row.block_weights = raw.block_weights;
    if (raw.expert && raw.expert !== "auto") row.expert = raw.expert;
    return row;
}

/**
 * The rows of a `rows` text: {rows, error}. Empty text is no rows; a text the server would refuse (not JSON, not a
 * list, a row of another shape) gives rows null and the error, so the editor never rewrites what it cannot read.
 */
export function parseRows(text) {
    if (!String(text ?? "").trim()) return { rows: [], error: null };
    let raw;
    try {
        raw = JSON.parse(text);
    } catch (e) {
        return { rows: null, error: `the rows are not JSON (${e.message})` };
    }
    if (!Array.isArray(raw)) return { rows: null, error: "the rows must be a JSON list of rows" };
    for (let i = 0; i < raw.length; i++) {
        const error = checkRow(raw[i], i + 1);
        if (error) return { rows: null, error };
    }
    return { rows: raw.map(normalRow), error: null };
}

// Edits: each returns new rows and leaves its argument as it was.

export function addRow(rows, lora = "") {
    return [...rows, { on: true, lora, strength: 1 }];
}

export function removeRow(rows, index) {
    return rows.filter((_, i) => i !== index);
}

/** Row `index` moved by `delta` places (-1: up); at either end it stays. */
export function moveRow(rows, index, delta) {
    const to = index + delta;
    if (to < 0 || to >= rows.length || index < 0 || index >= rows.length) return rows;
    const out = [...rows];
    [out[index], out[to]] = [out[to], out[index]];
    return out;
}

/** Every row off when all are on, else every row on (the header's switch). */
export function toggleAll(rows) {
    const on = !rows.every((r) => r.on);
    return rows.map((r) => ({ ...r, on }));
}

/** Row `index` with `key` set; null, "" (and "auto" for expert) remove an optional field, as rows.py leaves it out. */
export function setField(rows, index, key, value) {
    if (!FIELDS.includes(key)) throw new Error(`no row field '${key}'`);
    return rows.map((row, i) => {
        if (i !== index) return row;
        const out = { ...row, [key]: value };
        const unset = value == null || value === "" || (key === "expert" && value === "auto");
        if (unset && !["on", "lora", "strength"].includes(key)) delete out[key];
        return out;
    });
}

/**
 * The node's report (UI output `lycoris_rows`, one entry per applied row or tag) laid out for the rows now shown:
 * {byRow: entries per row index, others: the rest}. An entry goes under the row of its number when that row still
 * names its file, else under the first unclaimed row naming it (the rows were moved since the run), else in others.
 */
export function reportByRow(entries, rows) {
    const byRow = rows.map(() => []);
    const others = [];
    const claimed = new Set();
    for (const entry of Array.isArray(entries) ? entries : []) {
        if (!entry || typeof entry !== "object") continue;
        if (entry.source !== "row") {
            others.push(entry);
            continue;
        }
        const at = entry.row - 1;
        let index = rows[at]?.lora === entry.lora && !claimed.has(at) ? at : -1;
        if (index < 0) index = rows.findIndex((r, i) => r.lora === entry.lora && !claimed.has(i));
        if (index < 0) {
            others.push(entry);
            continue;
        }
        claimed.add(index);
        byRow[index].push(entry);
    }
    return { byRow, others };
}
