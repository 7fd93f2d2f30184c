// The H3 request geometry the conditioning node resolves, as plain functions (no DOM, no ComfyUI), so
// node can run them in the tests against h3_core/geometry.py and h3_core/conditioning.py.
// Keep in step with those files: tests/test_web_geometry.py compares the two.

export const FPS = 24;
export const FRAMES_PER_CHUNK = 17;
export const LATENTS_PER_CHUNK = 5;
export const CANVAS_MULTIPLE = 32;
export const MIN_SECONDS = 4.0;
export const MAX_SECONDS = 15.0;
export const RELEASE_RULES = { shortEdge: 768, maxPixels: 768 * 1344 };
export const TINY_RULES = { shortEdge: 128, maxPixels: 128 * 224 };
export const ASPECT_RATIOS = { "21:9": [21, 9], "16:9": [16, 9], "4:3": [4, 3], "1:1": [1, 1], "3:4": [3, 4], "9:16": [9, 16] };
export const DEFAULT_ASPECT_RATIO = "16:9";

// Python's round(): halves go to the even neighbour.
export function roundHalfEven(x) {
  const floor = Math.floor(x);
  const diff = x - floor;
  if (diff > 0.5) return floor + 1;
  if (diff < 0.5) return floor;
  return floor % 2 === 0 ? floor : floor + 1;
}

export function alignFrames(count) {
  const chunks = Math.max(0, Math.ceil((count - LATENTS_PER_CHUNK) / FRAMES_PER_CHUNK));
  return FRAMES_PER_CHUNK * chunks + LATENTS_PER_CHUNK;
}

export function framesForDuration(seconds) {
  return alignFrames(Math.max(1, roundHalfEven(seconds * FPS)));
}

export function canvasSize(aspectWidth, aspectHeight, rules = RELEASE_RULES) {
  const ratio = aspectWidth / aspectHeight;
  let width, height;
  if (ratio >= 1) { width = rules.shortEdge * ratio; height = rules.shortEdge; }
  else { width = rules.shortEdge; height = rules.shortEdge / ratio; }
  const area = width * height;
  if (area > rules.maxPixels) {
    const scale = Math.sqrt(rules.maxPixels / area);
    width *= scale; height *= scale;
  }
  const snap = (v) => Math.max(CANVAS_MULTIPLE, roundHalfEven(v / CANVAS_MULTIPLE) * CANVAS_MULTIPLE);
  return [snap(width), snap(height)];
}

// {task, aspect_ratio, width, height, duration} -> {width, height, frames, seconds} or {error}; width and
// height are null when the canvas follows a keyframe (fl2va with aspect_ratio auto). A value left undefined
// comes from a link, known only when the graph runs: what it decides is said to be linked (`linked`:
// "canvas" and/or "duration"), not computed from a widget the link overrides.
export function resolveRequest(values, rules = RELEASE_RULES) {
  const { task, aspect_ratio: aspect, width, height, duration } = values;
  if (duration !== undefined && !(duration >= MIN_SECONDS && duration <= MAX_SECONDS)) {
    return { error: `duration must be ${MIN_SECONDS}-${MAX_SECONDS} s` };
  }
  const frames = duration === undefined ? null : framesForDuration(duration);
  const out = { frames, seconds: frames === null ? null : frames / FPS, width: null, height: null,
                linked: frames === null ? ["duration"] : [] };
  const canvasLinked = width === undefined || height === undefined
    || (!width && !height && (aspect === undefined || (aspect === "auto" && task === undefined)));
  if (canvasLinked) return { ...out, linked: ["canvas", ...out.linked] };
  if (width || height) {
    if (!(width > 0 && height > 0) || width % CANVAS_MULTIPLE || height % CANVAS_MULTIPLE) {
      return { error: `width and height must both be multiples of ${CANVAS_MULTIPLE} (or both 0)` };
    }
    const ratio = width / height;
    if (ratio < 0.25 || ratio > 4) return { error: "the canvas must be between 1:4 and 4:1" };
    return { ...out, width, height };
  }
  if (aspect in ASPECT_RATIOS) {
    const [w, h] = canvasSize(...ASPECT_RATIOS[aspect], rules);
    return { ...out, width: w, height: h };
  }
  if (task === "fl2va") return out; // the first keyframe's shape decides
  const [w, h] = canvasSize(...ASPECT_RATIOS[DEFAULT_ASPECT_RATIO], rules);
  return { ...out, width: w, height: h };
}

// The node a link comes from, through Reroute nodes (each passes its one input on) and out of a subgraph through
// its input slot to what feeds the subgraph's node; null when it cannot be told (a subgraph placed by several
// nodes, say). `graph.links` is an object or a Map, as frontends keep it.
export function linkOrigin(graph, linkId) {
  for (let hops = 0; linkId != null && hops < 64; hops++) {
    const link = graph?.links?.[linkId] ?? graph?.links?.get?.(linkId);
    if (link && (link.originIsIoNode || link.origin_id === SUBGRAPH_INPUT_ID)) {
      const holders = subgraphNodes(graph);
      if (holders.length !== 1) return null;
      const name = graph.inputNode?.slots?.[link.origin_slot]?.name;
      const inputs = holders[0].inputs ?? [];
      const input = inputs.find((i) => name != null && i.name === name) ?? inputs[link.origin_slot];
      [graph, linkId] = [holders[0].graph, input?.link];
      continue;
    }
    const origin = link ? graph.getNodeById(link.origin_id) : null;
    if (!origin || origin.type !== "Reroute") return origin ?? null;
    linkId = origin.inputs?.[0]?.link;
  }
  return null;
}

// The frontend's id for a subgraph's input node, where the links from its input slots start.
export const SUBGRAPH_INPUT_ID = -10;

// The nodes that place `subgraph`, in the root graph and in every subgraph definition.
function subgraphNodes(subgraph) {
  const root = subgraph?.rootGraph;
  if (!root || root === subgraph) return [];
  const graphs = [root, ...(root.subgraphs?.values?.() ?? [])];
  return graphs.flatMap((g) => [...(g.nodes ?? g._nodes ?? [])])
    .filter((node) => node.isSubgraphNode?.() && node.subgraph === subgraph);
}

// A typed or pasted path as the nodes read it (nodes/model_folders.clean_path): spaces around it and one pair of
// quotes around it dropped; a box holding only those is empty.
export function cleanPath(text) {
  let path = String(text ?? "").trim();
  if (path.length >= 2 && path[0] === path[path.length - 1] && `"'`.includes(path[0])) path = path.slice(1, -1).trim();
  return path;
}

// A node's widget values by name; a widget whose socket is linked keeps an old value the frontend no longer
// sends, so its value is left undefined (known from the link only when the graph runs).
export function unlinkedValues(node, names) {
  const values = {};
  for (const name of names) {
    const linked = node.inputs?.some((i) => (i.widget?.name ?? i.name) === name && i.link != null);
    values[name] = linked ? undefined : node.widgets?.find((w) => w.name === name)?.value;
  }
  return values;
}

export function describe(result) {
  if (result.error) return `H3: ${result.error}`;
  const linked = result.linked ?? [];
  const canvas = linked.includes("canvas") ? "canvas from the links"
    : result.width ? `${result.width}x${result.height}` : "canvas from the keyframe";
  if (linked.includes("duration")) return `${canvas}, frame count from the linked duration`;
  return `${canvas}, ${result.frames} frames = ${result.seconds.toFixed(3)} s at ${FPS} fps`;
}
