// The node types the panel and the report go on, and the widget names they read or add: shared by the modules of
// web/panel/ and the entry (web/lycoris_panel.js). Only exports: the frontend imports every file under web/.

export const NODE_TYPES = ["LycorisLoader", "LycorisLoaderModelOnly", "LycorisInfo", "LycorisBlockWeights", "LycorisBlockInfo"];
export const BLOCK_EDITOR_TYPES = ["LycorisBlockWeights"];
// The tools (Save, Resize, Extract, Convert LyCORIS): their report (the node's "text" UI output) shown on the node.
export const TOOL_TYPES = ["LycorisSave", "LycorisResize", "LycorisExtract", "LycorisConvert"];
export const REPORT_WIDGET = "lycoris_report";
export const PANEL_WIDGET = "lycoris_panel";
export const NAME_WIDGET = "lycoris_name";
export const BLOCK_WEIGHTS_WIDGET = "block_weights";
export const PRESET_WIDGET = "preset";
export const CUSTOM_PRESET = "custom";
// The multi-file loaders (issue #36): the rows editor (web/panel/rows_editor.js) draws and rewrites their `rows` text.
export const ROWS_TYPES = ["LycorisRows", "LycorisExperts"];
export const EXPERTS_TYPE = "LycorisExperts"; // its rows also have a low-noise strength and an expert
export const ROWS_WIDGET = "rows";
export const ROWS_EDITOR_WIDGET = "lycoris_rows";
