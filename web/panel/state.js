// What the panels share across nodes. Only exports: the frontend imports every file under web/.

// Block names per file from the last report that listed them (any node type), so a Block Weights node can offer
// sliders after a LyCORIS Block Info run for its file; and the live panels, to redraw those when one arrives.
export const knownBlocks = new Map();
export const livePanels = new Set();
