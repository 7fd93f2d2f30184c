// Canvas (UI-format) workflows and screenshots from a running ComfyUI, through headless Chromium.
//
//   node tools/canvas.mjs build URL            workflows/templates/*.json (API format) -> example_workflows/*.json
//   node tools/canvas.mjs shot URL FILE PNG     load a canvas workflow into the page, screenshot it to PNG
//                                              (H3_EDIT='{"duration": 7.3}' sets H3 Conditioning widgets first)
//
// Needs `playwright-core` (npm) and Chromium (Debian's `chromium`; CHROMIUM overrides the path). The
// canvas files are what ComfyUI's own frontend makes of each API graph (app.loadApiJson then
// graph.serialize), plus a note with what to download; tools/workflows.py writes the API graphs.
import fs from "node:fs";
import path from "node:path";
import { createRequire } from "node:module";
import { fileURLToPath } from "node:url";

const require = createRequire(import.meta.url);
const { chromium } = require(process.env.PLAYWRIGHT_CORE || "playwright-core");
const ROOT = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "..");
const [mode, url, ...rest] = process.argv.slice(2);

const NOTE = `## MiniMax-H3 (video + audio)
Models (Comfy-Org/MiniMax-H3, the files ComfyUI's own H3 templates use; the loaders offer to download missing ones):
**diffusion_models/** minimax_h3_fl2va_pruned_int8_convrot or minimax_h3_ref2va_pruned_int8_convrot,
**text_encoders/** qwen3vl_32b_minimax_h3_nvfp4_awq (*tokenizer_folder*: the release's FL2VA/tokenizer, or empty to fetch it, 7 MiB),
**vae/** minimax_h3_video_vae_fp16 and minimax_h3_audio_vae_fp32; Turbo: **loras/**
minimax_h3_fl2v_turbo_8step_v1.0_comfyui_bf16. Other H3 files (bf16, fp8_scaled, NVFP4, GGUF) work too.
Or pick *tiny-random* everywhere to try the graph without weights.`;
// only for graphs that have the node each speaks of
const LORA_LINE = "\nWith tiny-random, bypass H3 LoRA / Turbo Apply: a real adapter does not fit the tiny model.";
const CONDITIONING_LINE = "\nThe line under H3 Conditioning shows the canvas, frames and real duration before you queue.";

function has(api, type) {
  return Object.values(api).some((node) => node.class_type === type);
}

async function openApp(browser) {
  const page = await browser.newPage({ viewport: { width: 1600, height: 1000 } });
  await page.addInitScript(() => {
    localStorage.setItem("Comfy.TutorialCompleted", "true");
    localStorage.setItem("Comfy.Settings.Comfy.TutorialCompleted", "true");
  });
  await page.goto(url, { waitUntil: "networkidle" });
  await page.waitForFunction(() => window.app?.graph && window.LiteGraph, null, { timeout: 60000 });
  return page;
}

async function build(browser) {
  const dir = path.join(ROOT, "workflows", "templates");
  const out = path.join(ROOT, "example_workflows");
  fs.mkdirSync(out, { recursive: true });
  for (const file of fs.readdirSync(dir).filter((f) => f.endsWith(".json")).sort()) {
    const api = JSON.parse(fs.readFileSync(path.join(dir, file), "utf8"));
    // a page per file: in one page a canvas was once saved with the previous file's note
    const page = await openApp(browser);
    const canvas = await page.evaluate(async ({ api, name, note }) => {
      await window.app.loadApiJson(api, name);
      const graph = window.app.graph;
      const memo = window.LiteGraph.createNode("MarkdownNote");
      memo.pos = [0, -260];
      memo.size = [560, 220];
      memo.widgets[0].value = note;
      graph.add(memo);
      return graph.serialize();
    }, { api, name: file, note: NOTE + (has(api, "H3LoRAApply") ? LORA_LINE : "")
      + (has(api, "H3Conditioning") ? CONDITIONING_LINE : "") });
    await page.close();
    fs.writeFileSync(path.join(out, file), JSON.stringify(canvas, null, 2) + "\n");
    console.log(`example_workflows/${file}: ${canvas.nodes.length} nodes, ${canvas.links.length} links`);
  }
}

async function shot(browser, file, png) {
  const page = await openApp(browser);
  const workflow = JSON.parse(fs.readFileSync(file, "utf8"));
  const edit = JSON.parse(process.env.H3_EDIT || "{}");
  const resolved = await page.evaluate(async ({ workflow, edit }) => {
    await window.app.loadGraphData(workflow);
    const cond = window.app.graph.nodes.find((n) => n.type === "H3Conditioning");
    for (const [name, value] of Object.entries(edit)) cond.widgets.find((w) => w.name === name).value = value;
    window.app.canvas.ds.offset = [40, 330];
    window.app.canvas.ds.scale = 0.62;
    window.app.graph.setDirtyCanvas(true, true);
    await new Promise((done) => setTimeout(done, 1500));
    return cond?.h3Resolved ?? null;
  }, { workflow, edit });
  await page.screenshot({ path: png });
  console.log(JSON.stringify({ screenshot: png, conditioning_line: resolved }));
}

const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
  args: ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update", "--no-first-run"],
});
try {
  if (mode === "build") await build(browser);
  else if (mode === "shot") await shot(browser, rest[0], rest[1]);
  else throw new Error("usage: node tools/canvas.mjs build URL | shot URL FILE PNG");
} finally {
  await browser.close();
}
