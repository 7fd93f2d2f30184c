"""The pack inside a real ComfyUI server (testing.md section 3). Needs COMFYUI_PATH (a ComfyUI tree)
and a Python that runs it (COMFYUI_PYTHON, default: the one running the tests) with this pack
installed; skips with a message otherwise. Starts the server on a free loopback port with the pack
linked into custom_nodes (and a tiny Turbo LoRA under the file name the turbo workflow names), then:
/object_info and the template list, every API workflow to an MP4 on tiny-random with progress and
previews on the websocket, an output list, node errors at queue time, a bad sigma ladder, an interrupt
mid-sampling, /free releasing our models, our latents through ComfyUI's own AV latent nodes, and the real-file
templates through /prompt's checks. Also, in process: Load Video's VIDEO class read from its file, and ComfyUI's
own H3 audio VAE on our latents."""

import asyncio
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

PACK = Path(__file__).resolve().parents[1]
WORKFLOWS = sorted((PACK / "workflows" / "api").glob("*.json"))
TEMPLATES = sorted((PACK / "example_workflows").glob("*.json"))
NODE_IDS = ["H3ModelLoader", "H3TextEncoderLoader", "H3VAELoader", "H3Conditioning", "H3EmptyAVLatent", "H3Sampler",
            "H3LoRAApply", "H3VAEDecode", "H3AVSave", "H3AddGuide", "H3Continuation", "H3ContinuationGuide", "H3SaveMP4",
            "H3VAEEncode", "H3LatentToLatent", "H3LatentFromLatent", "H3SaveLatent", "H3LoadLatent"]
TURBO_LORA = "minimax_h3_fl2v_turbo_8step_v1.0_comfyui_bf16.safetensors"
COMFYUI = os.environ.get("COMFYUI_PATH")
PREVIEW_EVENTS = (1, 4)  # ComfyUI's binary PREVIEW_IMAGE and PREVIEW_IMAGE_WITH_METADATA

pytestmark = pytest.mark.skipif(
    not COMFYUI, reason="COMFYUI_PATH is not set: no ComfyUI checkout to start (see shared docs testing.md section 3)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str):
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


def _post(url: str, body: dict):
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


def _write_turbo_lora(folder: Path) -> None:
    """A tiny-random-shaped adapter in the LightX2V `_comfyui_` layout, under the real Turbo file name."""
    sys.path.insert(0, str(Path(__file__).parent))
    from lora_files import fused, random_spec, write_native

    from h3_core.config import TINY_DIT

    write_native(folder / TURBO_LORA, fused(random_spec(TINY_DIT), block_diagonal=True), prefix="diffusion_model.")


class Socket:
    """The server's websocket for one client id, read on a thread: JSON messages and binary previews."""

    def __init__(self, base: str):
        import aiohttp

        self.client_id = uuid.uuid4().hex
        self.messages, self.previews = [], []
        url = base.replace("http", "ws") + f"/ws?clientId={self.client_id}"
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()

        async def read():
            try:
                async with aiohttp.ClientSession() as session, session.ws_connect(url) as ws:
                    ready.set()
                    async for message in ws:
                        if message.type == aiohttp.WSMsgType.TEXT:
                            self.messages.append(json.loads(message.data))
                        elif message.type == aiohttp.WSMsgType.BINARY:
                            self.previews.append(struct.unpack(">I", message.data[:4])[0])
            except asyncio.CancelledError:  # close()
                pass

        self._thread = threading.Thread(target=lambda: self._loop.run_until_complete(read()), daemon=True)
        self._thread.start()
        assert ready.wait(30), "no websocket connection"

    def of(self, kind: str, prompt_id: str):
        return [m["data"] for m in self.messages if m["type"] == kind and m["data"].get("prompt_id") == prompt_id]

    def close(self):
        for task in asyncio.all_tasks(self._loop):
            self._loop.call_soon_threadsafe(task.cancel)
        self._thread.join(5)


FOUR_BLOCKS_GGUF = "h3_tiny_4_blocks-Q8_0.gguf"


def _write_four_blocks_gguf(folder: Path) -> None:
    """The 4-block tiny DiT as ComfyUI-GGUF stores it: its block linears Q8_0, the rest F16 / F32."""
    import gguf_files
    from safetensors.torch import load_file
    from test_nodes_memory import FOUR_BLOCKS

    from h3_core.keymap import strip_prefix

    tensors = load_file(str(folder / FOUR_BLOCKS))
    linears = {key: "Q8_0" for key, value in tensors.items() if strip_prefix(key).startswith("blocks.")
               and value.ndim == 2 and not key.endswith("adaln_proj.linear.weight")}
    gguf_files.write_gguf(folder / FOUR_BLOCKS_GGUF, tensors, linears)


@pytest.fixture(scope="module")
def server():
    root = Path(COMFYUI)
    if not (root / "main.py").is_file():
        pytest.fail(f"COMFYUI_PATH={COMFYUI} holds no main.py")
    python = os.environ.get("COMFYUI_PYTHON", sys.executable)
    work = Path(tempfile.mkdtemp(prefix="h3-comfy-"))
    nodes_dir, loras = work / "custom_nodes", work / "loras"
    nodes_dir.mkdir()
    loras.mkdir()
    _write_turbo_lora(loras)
    from test_nodes_memory import write_four_blocks

    write_four_blocks(work / "diffusion_models")
    _write_four_blocks_gguf(work / "diffusion_models")
    (nodes_dir / "comfyui-h3").symlink_to(PACK, target_is_directory=True)
    config = work / "extra_model_paths.yaml"
    config.write_text(f"h3test:\n  base_path: {work}\n  custom_nodes: custom_nodes\n  loras: loras\n"
                      "  diffusion_models: diffusion_models\n  text_encoders: text_encoders\n  vae: vae\n")
    port = _free_port()
    log = open(work / "server.log", "w")  # noqa: SIM115 (closed after the server stops)
    process = subprocess.Popen(
        [python, "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(port), "--disable-auto-launch",
         "--disable-api-nodes", "--extra-model-paths-config", str(config), "--output-directory", str(work / "output"),
         "--input-directory", str(work / "input"),
         "--disable-all-custom-nodes", "--whitelist-custom-nodes", "comfyui-h3", "--preview-method", "auto"],
        cwd=root, stdout=log, stderr=subprocess.STDOUT,
        env={name: value for name, value in os.environ.items() if name != "H3_ALLOW_ANY_FOLDER"})  # fenced loaders
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                _get(f"{base}/system_stats")
                break
            except (urllib.error.URLError, ConnectionError, OSError):
                if process.poll() is not None or time.monotonic() > deadline:
                    pytest.fail("ComfyUI did not start:\n" + (work / "server.log").read_text()[-4000:])
                time.sleep(1)
        yield base, work
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()
        shutil.rmtree(work, ignore_errors=True)


@pytest.fixture(scope="module")
def ws(server):
    sock = Socket(server[0])
    yield sock
    sock.close()


def _queue(base: str, graph: dict, client_id: str, extra_data: dict | None = None) -> str:
    status, body = _post(f"{base}/prompt", {"prompt": graph, "client_id": client_id, **(
        {"extra_data": extra_data} if extra_data else {})})
    assert status == 200, body
    return body["prompt_id"]


def _wait(base: str, prompt_id: str, seconds: float = 300) -> dict:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        history = _get(f"{base}/history/{prompt_id}").get(prompt_id)
        if history and history.get("status", {}).get("status_str") in ("success", "error"):
            return history
        time.sleep(0.5)
    pytest.fail(f"prompt {prompt_id} did not finish in {seconds} s")


def _mp4s(history: dict) -> list[dict]:
    return [v for out in history["outputs"].values() for v in out.get("images", []) if v["filename"].endswith(".mp4")]


def _node(graph: dict, class_type: str) -> str:
    return next(key for key, node in graph.items() if node["class_type"] == class_type)


def _log(work: Path) -> str:
    return (work / "server.log").read_text(errors="replace")


def test_pack_loads_and_lists_nodes(server):
    base, work = server
    info = _get(f"{base}/object_info")
    missing = [node for node in NODE_IDS if node not in info]
    assert not missing, f"not in /object_info: {missing}\n" + _log(work)[-4000:]
    assert all(info[node]["category"] == "H3" for node in NODE_IDS)
    assert info["H3Sampler"]["output"] == ["H3_LATENT"] and info["H3Sampler"]["output_is_list"] == [True]
    assert info["H3Conditioning"]["input"]["optional"]["references"][0] == "COMFY_AUTOGROW_V3"
    assert TURBO_LORA in info["H3LoRAApply"]["input"]["required"]["lora_name"][1]["options"]
    log = _log(work)
    assert "IMPORT FAILED" not in log and "Cannot import" not in log, log[-4000:]


def test_node_translations_are_served(server):
    """ComfyUI hands our locales/<lang>/nodeDefs.json to its frontend through /i18n."""
    base, _ = server
    translations = _get(f"{base}/i18n")
    ours = json.loads((PACK / "locales" / "zh" / "nodeDefs.json").read_text(encoding="utf-8"))
    assert translations["zh"]["nodeDefs"]["H3Sampler"] == ours["H3Sampler"]


def test_node_help_pages_are_served(server):
    """ComfyUI's frontend fetches a custom node's help page from /extensions/<pack folder>/docs/<node id>.md."""
    base, _ = server
    for node in NODE_IDS:
        with urllib.request.urlopen(f"{base}/extensions/comfyui-h3/docs/{node}.md") as response:
            assert response.read().decode() == (PACK / "web" / "docs" / f"{node}.md").read_text(), node


def test_canvas_workflows_are_templates(server):
    """ComfyUI's template browser lists example_workflows/ under the pack's folder name and serves each file."""
    base, _ = server
    listed = _get(f"{base}/workflow_templates").get("comfyui-h3", [])
    assert sorted(listed) == sorted(t.stem for t in TEMPLATES) and listed
    served = _get(f"{base}/api/workflow_templates/comfyui-h3/{TEMPLATES[0].name}")
    assert served["nodes"] and served == json.loads(TEMPLATES[0].read_text())
    thumbnail = TEMPLATES[0].with_suffix(".jpg")  # the card's picture, at the address the frontend asks
    with urllib.request.urlopen(f"{base}/api/workflow_templates/comfyui-h3/{thumbnail.name}", timeout=30) as response:
        assert response.read() == thumbnail.read_bytes()


@pytest.mark.parametrize("workflow", WORKFLOWS, ids=[w.stem for w in WORKFLOWS])
def test_api_workflow_writes_mp4(server, ws, workflow):
    import av

    base, work = server
    graph = json.loads(workflow.read_text())
    canvas = {"nodes": [], "links": [], "extra": {"from": workflow.stem}}  # what the frontend sends along
    prompt_id = _queue(base, graph, ws.client_id, {"extra_pnginfo": {"workflow": canvas}})
    history = _wait(base, prompt_id)
    assert history["status"]["status_str"] == "success", json.dumps(history["status"]["messages"])[-4000:]
    saved = _mp4s(history)
    savers = [node for node in graph.values() if node["class_type"] in ("H3AVSave", "H3SaveMP4")]
    assert len(saved) == len(savers), history["outputs"]
    frames = []
    for item in saved:
        with av.open(str(work / "output" / item["subfolder"] / item["filename"])) as container:
            assert sorted(s.type for s in container.streams) == ["audio", "video"]
            video, audio = container.streams.video[0], container.streams.audio[0]
            assert video.codec_context.name == "h264" and audio.codec_context.name == "aac"
            assert audio.codec_context.sample_rate == 32000
            frames.append(sum(1 for _ in container.decode(video=0)))
            tags = dict(container.metadata)
        # dropped on the canvas, the MP4 gives back its workflow (as ComfyUI's SaveVideo files do)
        assert json.loads(tags["workflow"]) == canvas and set(json.loads(tags["prompt"])) == set(graph)
    if any(node["class_type"] == "H3Sampler" for node in graph.values()):  # our single-window workflows: 4 s
        assert 107 in frames  # 4 s -> 17n + 5 frames
        sampler = _node(graph, "H3Sampler")
        progress = [m for m in ws.of("progress", prompt_id) if m["node"] == sampler]
        assert progress and progress[-1]["value"] == progress[-1]["max"], ws.of("progress", prompt_id)
    if any(node["class_type"] == "H3Continuation" for node in graph.values()):  # longer than one window
        assert max(frames) > 107


def test_previews_and_output_list(server, ws):
    """outputs=2: two MP4s (seeds 0 and 1) from one sampler, progress over both, a JPEG preview per step."""
    base, _ = server
    graph = json.loads((PACK / "workflows" / "api" / "t2va.json").read_text())
    sampler = _node(graph, "H3Sampler")
    graph[sampler]["inputs"].update(outputs=2, steps=3, seed=7)
    before = len(ws.previews)
    prompt_id = _queue(base, graph, ws.client_id)
    history = _wait(base, prompt_id)
    assert history["status"]["status_str"] == "success", json.dumps(history["status"]["messages"])[-4000:]
    assert len(_mp4s(history)) == 2, history["outputs"]
    progress = [m for m in ws.of("progress", prompt_id) if m["node"] == sampler]
    assert progress[-1]["value"] == progress[-1]["max"] == 4  # 2 outputs x 2 model calls
    previews = [kind for kind in ws.previews[before:] if kind in PREVIEW_EVENTS]
    assert len(previews) >= 4, ws.previews[before:]


def test_bad_prompt_is_a_node_error_and_server_goes_on(server):
    base, _ = server
    graph = json.loads((PACK / "workflows" / "api" / "t2va.json").read_text())
    sampler = _node(graph, "H3Sampler")
    graph[sampler]["inputs"]["steps"] = 10_000  # above the schema's max
    status, body = _post(f"{base}/prompt", {"prompt": graph, "client_id": "x"})
    assert status == 400 and sampler in body.get("node_errors", {}), body

    # ten image references: more than H3 takes, refused at queue time by the conditioning node
    graph = json.loads((PACK / "workflows" / "api" / "ref2va_images.json").read_text())
    cond = _node(graph, "H3Conditioning")
    image = graph[cond]["inputs"]["references.ref0"]
    for index in range(10):
        graph[cond]["inputs"][f"references.ref{index}"] = image
    status, body = _post(f"{base}/prompt", {"prompt": graph, "client_id": "x"})
    assert status == 400 and cond in body.get("node_errors", {}), body
    assert "at most 9 image references" in json.dumps(body["node_errors"][cond]), body

    # the conditioning node's own check leaves ComfyUI's range checks and link types to the other inputs
    graph = json.loads((PACK / "workflows" / "api" / "t2va.json").read_text())
    cond = _node(graph, "H3Conditioning")
    graph[cond]["inputs"]["duration"] = 1000.0
    graph[cond]["inputs"]["prompt"] = [_node(graph, "H3VAELoader"), 0]
    status, body = _post(f"{base}/prompt", {"prompt": graph, "client_id": "x"})
    errors = json.dumps(body.get("node_errors", {}).get(cond))
    assert status == 400 and "bigger than max" in errors and "prompt takes STRING, got H3_VAE" in errors, body

    # a canvas the model cannot make is refused at queue time, its range too (ComfyUI's check is off for it)
    graph = json.loads((PACK / "workflows" / "api" / "t2va.json").read_text())
    cond = _node(graph, "H3Conditioning")
    graph[cond]["inputs"].update(width=100, height=768)
    status, body = _post(f"{base}/prompt", {"prompt": graph, "client_id": "x"})
    assert status == 400 and "multiples of 32" in json.dumps(body.get("node_errors", {}).get(cond)), body
    graph[cond]["inputs"].update(width=8192, height=4096)
    status, body = _post(f"{base}/prompt", {"prompt": graph, "client_id": "x"})
    assert status == 400 and "at most 4096" in json.dumps(body.get("node_errors", {}).get(cond)), body

    # an empty prompt, the default of a fresh node, is refused before the text encoder is read
    graph = json.loads((PACK / "workflows" / "api" / "t2va.json").read_text())
    cond = _node(graph, "H3Conditioning")
    graph[cond]["inputs"]["prompt"] = " "
    status, body = _post(f"{base}/prompt", {"prompt": graph, "client_id": "x"})
    assert status == 400 and "The prompt is empty" in json.dumps(body.get("node_errors", {}).get(cond)), body

    # a link into a choice list must bring a COMBO (an image into aspect_ratio ran, then failed printing a tensor)
    graph = json.loads((PACK / "workflows" / "api" / "t2va_guides.json").read_text())
    cond = _node(graph, "H3Conditioning")
    graph[cond]["inputs"]["aspect_ratio"] = [_node(graph, "EmptyImage"), 0]
    status, body = _post(f"{base}/prompt", {"prompt": graph, "client_id": "x"})
    assert status == 400 and "aspect_ratio takes COMBO, got IMAGE" in json.dumps(body.get("node_errors")), body

    # H3 AV Save runs last: its wiring (images or a video) is refused at queue time, not after the sampling
    graph = json.loads((PACK / "workflows" / "api" / "t2va.json").read_text())
    save = _node(graph, "H3AVSave")
    graph[save]["inputs"].pop("images", None)
    status, body = _post(f"{base}/prompt", {"prompt": graph, "client_id": "x"})
    assert status == 400 and "or a video, got neither" in json.dumps(body.get("node_errors", {}).get(save)), body

    # the sampler's keep / denoise with no latent linked, and a decode's devices, are refused at queue time (they
    # failed only after the text encoder had run, or the sampling); the ranges they turn off are checked again
    graph = json.loads((PACK / "workflows" / "api" / "t2va.json").read_text())
    sampler, decode = _node(graph, "H3Sampler"), _node(graph, "H3VAEDecode")
    graph[sampler]["inputs"].update(keep="video", outputs=1000)
    graph[decode]["inputs"]["devices"] = "cuda0"
    status, body = _post(f"{base}/prompt", {"prompt": graph, "client_id": "x"})
    errors = json.dumps(body.get("node_errors", {}))
    assert status == 400 and "outputs: Value 1000 bigger than max of 64" in errors, body
    assert "'cuda0' is not a list of device names" in errors, body
    graph[sampler]["inputs"]["outputs"] = 1
    graph[decode]["inputs"]["devices"] = ""
    del graph[sampler]["inputs"]["latent"]  # nothing to keep the video of
    status, body = _post(f"{base}/prompt", {"prompt": graph, "client_id": "x"})
    assert status == 400 and "keep = video holds the video of the connected latent" in json.dumps(
        body.get("node_errors", {}).get(sampler)), body

    # a wrong link into a guide is named by it at queue time (asking for input_types, it checks them itself)
    graph = json.loads((PACK / "workflows" / "api" / "t2va_guides.json").read_text())
    guide = _node(graph, "H3AddGuide")
    graph[guide]["inputs"].update(image=[_node(graph, "EmptyImage"), 0], video=[_node(graph, "EmptyImage"), 0])
    status, body = _post(f"{base}/prompt", {"prompt": graph, "client_id": "x"})
    errors = json.dumps(body.get("node_errors", {}).get(guide))
    assert status == 400 and "video takes VIDEO, got IMAGE" in errors, body
    graph[guide]["inputs"].pop("video")
    graph[guide]["inputs"]["audio"] = [_node(graph, "EmptyImage"), 0]
    status, body = _post(f"{base}/prompt", {"prompt": graph, "client_id": "x"})
    assert status == 400 and "audio takes AUDIO, got IMAGE" in json.dumps(body.get("node_errors", {}).get(guide)), body

    # H3 Continuation's wiring is refused at queue time too (before the loaders run), its ranges still by ComfyUI
    graph = json.loads((PACK / "workflows" / "api" / "extend_video.json").read_text())
    continuation = _node(graph, "H3Continuation")
    del graph[_node(graph, "H3SaveMP4")]  # the first clip's own output, which would still run (ComfyUI queues the
    # outputs whose nodes pass)
    graph[continuation]["inputs"]["keep_video"] = graph[continuation]["inputs"]["continue_from"]
    graph[continuation]["inputs"]["window_frames"] = 100_000
    status, body = _post(f"{base}/prompt", {"prompt": graph, "client_id": "x"})
    errors = json.dumps(body.get("node_errors", {}).get(continuation))
    assert status == 400 and "it cannot go with continue_from" in errors and "bigger than max" in errors, body
    # and a window plan the widgets cannot make, before the model loader reads a byte
    graph = json.loads((PACK / "workflows" / "api" / "long_video.json").read_text())
    continuation = _node(graph, "H3Continuation")
    graph[continuation]["inputs"]["overlap_frames"] = 30
    status, body = _post(f"{base}/prompt", {"prompt": graph, "client_id": "x"})
    errors = json.dumps(body.get("node_errors", {}).get(continuation))
    assert status == 400 and "The overlap frame count must be of the form 17n + 5" in errors, body

    # a sound socket linked to an output that holds none (a video without sound) is refused, not left out
    graph = json.loads((PACK / "workflows" / "api" / "ref2va_video.json").read_text())
    cond, video = _node(graph, "H3Conditioning"), _node(graph, "CreateVideo")
    graph[video]["inputs"].pop("audio")
    graph["90"] = {"class_type": "GetVideoComponents", "inputs": {"video": [video, 0]}}
    graph[cond]["inputs"]["references.ref1"] = ["90", 1]
    history = _wait(base, _queue(base, graph, "x"))
    assert history["status"]["status_str"] == "error"
    assert "references.ref1 is connected, but GetVideoComponents gave nothing for it" in json.dumps(
        history["status"]["messages"]), history["status"]

    # a value typed into a reference slot (no canvas box there) is a node error at queue time, not at run time
    graph = json.loads((PACK / "workflows" / "api" / "ref2va_images.json").read_text())
    cond = _node(graph, "H3Conditioning")
    graph[cond]["inputs"]["references.ref1"] = "foo.png"
    status, body = _post(f"{base}/prompt", {"prompt": graph, "client_id": "x"})
    assert status == 400 and ("references.ref1 holds a value, not a link: a reference is an IMAGE, VIDEO or AUDIO "
                              "output linked to it") in json.dumps(body.get("node_errors", {}).get(cond)), body

    # a slot past ref11: ComfyUI drops it from its checks and hands it to the node, which names it
    graph = json.loads((PACK / "workflows" / "api" / "ref2va_images.json").read_text())
    cond = _node(graph, "H3Conditioning")
    graph[cond]["inputs"]["references.ref12"] = graph[cond]["inputs"]["references.ref0"]
    history = _wait(base, _queue(base, graph, "x"))
    assert history["status"]["status_str"] == "error"
    assert "references.ref12: no such input; references go from ref0 to ref11" in json.dumps(
        history["status"]["messages"]), history["status"]

    graph = json.loads((PACK / "workflows" / "api" / "t2va.json").read_text())
    history = _wait(base, _queue(base, graph, "x"))
    assert history["status"]["status_str"] == "success"


def test_bad_sigmas_are_a_clear_error(server):
    base, _ = server
    graph = json.loads((PACK / "workflows" / "api" / "t2va.json").read_text())
    sampler = _node(graph, "H3Sampler")
    graph["90"] = {"class_type": "ManualSigmas", "inputs": {"sigmas": "1.0, 0.5, 0.7"}}
    graph[sampler]["inputs"]["video_sigmas"] = ["90", 0]
    history = _wait(base, _queue(base, graph, "x"))
    assert history["status"]["status_str"] == "error"
    assert "video_sigmas: Custom sigmas must be at least two strictly decreasing values ending at 0.0" in json.dumps(
        history["status"]["messages"])


def test_interrupt_stops_within_one_step(server, ws):
    base, _ = server
    graph = json.loads((PACK / "workflows" / "api" / "t2va.json").read_text())
    sampler = _node(graph, "H3Sampler")
    graph[sampler]["inputs"].update(steps=200, seed=11)
    prompt_id = _queue(base, graph, ws.client_id)
    deadline = time.monotonic() + 120
    while not any(m["node"] == sampler and m["value"] >= 3 for m in ws.of("progress", prompt_id)):
        assert time.monotonic() < deadline, "sampling never started"
        time.sleep(0.02)
    _post(f"{base}/interrupt", {})
    at_interrupt = max(m["value"] for m in ws.of("progress", prompt_id) if m["node"] == sampler)
    history = _wait(base, prompt_id)
    assert history["status"]["status_str"] == "error"
    assert any(kind == "execution_interrupted" for kind, _ in history["status"]["messages"])
    reached = max(m["value"] for m in ws.of("progress", prompt_id) if m["node"] == sampler)
    assert reached <= at_interrupt + 1 < 199, (at_interrupt, reached)
    history = _wait(base, _queue(base, json.loads((PACK / "workflows" / "api" / "t2va.json").read_text()), "x"))
    assert history["status"]["status_str"] == "success"  # the next prompt runs


def _wait_for_log(work: Path, text: str, seconds: float = 60) -> str:
    deadline = time.monotonic() + seconds
    while text not in _log(work) and time.monotonic() < deadline:
        time.sleep(0.5)
    return _log(work)


def _free_until(base: str, work: Path, text: str, body: dict | None = None, tries: int = 3) -> str:
    """POST /free until `text` is logged. ComfyUI's queue loop reads its flags, may collect garbage, then waits:
    a /free arriving between the two wakes nothing and waits for the next prompt (its main.py; seen in this
    suite when the machine is busy), so an unanswered /free is posted again."""
    for _ in range(tries):
        status, _ = _post(f"{base}/free", body or {"unload_models": True})
        assert status == 200
        log = _wait_for_log(work, text, seconds=20)
        if text in log:
            break
    return log


def test_a_small_gpu_memory_budget_streams_blocks_and_free_unloads_them(server):
    """gpu_memory_gb below what the whole DiT needs: the engine plans 0 of 4 blocks resident, the rest
    streamed (the same path a 24 GB card takes with the real model), and /free removes the streaming."""
    from test_nodes_memory import FOUR_BLOCKS, streaming_budget

    from h3_core.conditioning import Request, encode_request
    from h3_core.pipeline import TINY_CANVAS
    from h3_core.tiny_text import tiny_random_text_encoder

    base, work = server
    graph = json.loads((PACK / "workflows" / "api" / "t2va.json").read_text())
    cond = graph[_node(graph, "H3Conditioning")]["inputs"]
    steps = graph[_node(graph, "H3Sampler")]["inputs"]["steps"]
    layout = encode_request(Request(cond["task"], cond["prompt"], duration=cond["duration"]),
                            tiny_random_text_encoder(), rules=TINY_CANVAS).layout
    graph[_node(graph, "H3ModelLoader")]["inputs"].update(checkpoint=FOUR_BLOCKS, weight_dtype="fp32",
                                                          gpu_memory_gb=streaming_budget(layout, steps))
    history = _wait(base, _queue(base, graph, "x"))
    assert history["status"]["status_str"] == "success", json.dumps(history["status"]["messages"])[-4000:]
    assert len(_mp4s(history)) == 1
    assert "blocks resident, rest streamed" in _log(work), _log(work)[-4000:]
    assert f"{FOUR_BLOCKS}): reading its weights onto cpu" in _log(work)  # at the run, not by the loader
    log = _free_until(base, work, "block streaming removed")
    assert any(FOUR_BLOCKS in line and "unloaded from cpu" in line and "block streaming removed" in line
               for line in log.splitlines()), log[-4000:]


def test_a_gguf_file_is_offered_and_makes_a_clip(server):
    """ComfyUI lists only its own weight suffixes; the Model Loader also offers models/diffusion_models' .gguf
    files, and a workflow runs on one with its quantized linears kept."""
    base, work = server
    options = _get(f"{base}/object_info/H3ModelLoader")["H3ModelLoader"]["input"]["required"]["checkpoint"]
    assert FOUR_BLOCKS_GGUF in json.dumps(options), options
    graph = json.loads((PACK / "workflows" / "api" / "t2va.json").read_text())
    graph[_node(graph, "H3ModelLoader")]["inputs"].update(checkpoint=FOUR_BLOCKS_GGUF, weight_dtype="checkpoint")
    history = _wait(base, _queue(base, graph, "x"))
    assert history["status"]["status_str"] == "success", json.dumps(history["status"]["messages"])[-4000:]
    assert len(_mp4s(history)) == 1
    assert f"{FOUR_BLOCKS_GGUF}): reading its weights" in _log(work), _log(work)[-4000:]


def test_a_typed_folder_is_fenced_into_the_model_folders(server):
    """The Model Loader's folder box: a path outside ComfyUI's model folders is a node error at queue time; a
    file named relative to them (here a folder extra_model_paths.yaml adds) makes the clip."""
    from test_nodes_memory import FOUR_BLOCKS

    base, work = server
    graph = json.loads((PACK / "workflows" / "api" / "t2va.json").read_text())
    loader = _node(graph, "H3ModelLoader")
    graph[loader]["inputs"]["folder"] = str(work)  # the server's scratch folder: outside models/
    status, body = _post(f"{base}/prompt", {"prompt": graph, "client_id": "x"})
    errors = json.dumps(body.get("node_errors", {}).get(loader))
    assert status == 400 and "is outside ComfyUI's model folders" in errors, body
    graph[loader]["inputs"]["folder"] = FOUR_BLOCKS
    before = len(_log(work))
    history = _wait(base, _queue(base, graph, "x"))
    assert history["status"]["status_str"] == "success", json.dumps(history["status"]["messages"])[-4000:]
    this_run = _log(work)[before:]
    assert f"H3 DiT (fl2va, {FOUR_BLOCKS})" in this_run and "tiny-random" not in this_run, this_run


def test_a_small_text_encoder_budget_streams_its_layers_and_free_unloads_them(server):
    """The Text Encoder Loader's gpu_memory_gb below the encoder's weights + activations: it waits in CPU
    memory and its layers visit the device one at a time (the path a 24 GB card takes with the 48 GiB
    encoder); /free removes the hooks."""
    base, work = server
    graph = json.loads((PACK / "workflows" / "api" / "t2va.json").read_text())
    graph[_node(graph, "H3TextEncoderLoader")]["inputs"].update(gpu_memory_gb=1.0)
    history = _wait(base, _queue(base, graph, "x"))
    assert history["status"]["status_str"] == "success", json.dumps(history["status"]["messages"])[-4000:]
    assert len(_mp4s(history)) == 1
    log = _log(work)
    assert "does not fit in 1.00 GiB on cpu (less the allocator's headroom: 0.70); its decoder layers will stream" in log, log[-4000:]
    assert "decoder layers stay in CPU memory" in log, log[-4000:]
    log = _free_until(base, work, "layer streaming removed")
    assert any("H3 text encoder" in line and "unloaded from cpu" in line and "layer streaming removed" in line
               for line in log.splitlines()), log[-4000:]


def test_two_devices_split_the_dit_and_free_stops_the_workers(server):
    """devices "cpu,cpu": two worker processes (gloo) hold the DiT; the workflow runs through them, the
    Turbo workflow too (its LoRA hooked into the workers), and /free stops them."""
    base, work = server
    for name in ("t2va", "t2va_turbo"):
        graph = json.loads((PACK / "workflows" / "api" / f"{name}.json").read_text())
        graph[_node(graph, "H3ModelLoader")]["inputs"].update(devices="cpu,cpu")
        history = _wait(base, _queue(base, graph, "x"))
        assert history["status"]["status_str"] == "success", json.dumps(history["status"]["messages"])[-4000:]
        assert len(_mp4s(history)) == 1
    assert "workers started on cpu, cpu" in _log(work)
    log = _free_until(base, work, "workers on cpu, cpu stopped")
    assert "workers on cpu, cpu stopped" in log, log[-4000:]


def test_free_releases_our_models(server):
    """POST /free: "unload models" moves ours off the device (a log line each), "free memory" drops
    ComfyUI's caches and our models are garbage-collected (their release lines)."""
    base, work = server

    def released() -> bool:
        log = _log(work)
        return all(f"H3: H3 {what}" in log and "released" in log.split(f"H3: H3 {what}")[-1]
                   for what in ("DiT", "text encoder", "VAEs"))

    # ComfyUI collects garbage once after a /free: a model something still held for a moment then waits for the
    # next collection, which a second /free asks for (the VAEs missed the first one twice in long runs, cause not
    # found). A model we keep holding stays after both.
    for _ in range(2):
        status, _ = _post(f"{base}/free", {"unload_models": True, "free_memory": True})
        assert status == 200
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not released():
            time.sleep(0.5)
        if released():
            break
    log = _log(work)
    for what in ("DiT", "text encoder", "VAEs"):
        lines = [line for line in log.splitlines() if f"H3: H3 {what}" in line]
        assert any("unloaded from cpu" in line for line in lines), lines
        assert any("released" in line for line in lines), lines


def test_latents_cross_comfyuis_own_av_latent_nodes(server):
    """An empty latent from ComfyUI's own Empty MiniMax H3 AV Latent sizes our sampler; its result goes out as a
    core LATENT through Separate and Concat AV Latent and back, to our decode and MP4: same frames as direct."""
    import av

    base, work = server
    graph = json.loads((PACK / "workflows" / "api" / "t2va.json").read_text())
    sampler, decode = _node(graph, "H3Sampler"), _node(graph, "H3VAEDecode")
    graph.update({
        "n1": {"class_type": "EmptyMiniMaxH3LatentAV", "inputs": {"width": 224, "height": 128, "length": 107}},
        "n2": {"class_type": "H3LatentFromLatent", "inputs": {"latent": ["n1", 0]}},
        "n3": {"class_type": "H3LatentToLatent", "inputs": {"latent": [sampler, 0]}},
        "n4": {"class_type": "LTXVSeparateAVLatent", "inputs": {"av_latent": ["n3", 0]}},
        "n5": {"class_type": "LTXVConcatAVLatent", "inputs": {"video_latent": ["n4", 0], "audio_latent": ["n4", 1]}},
        "n6": {"class_type": "H3LatentFromLatent", "inputs": {"latent": ["n5", 0]}},
    })
    graph[sampler]["inputs"].update(latent=["n2", 0], steps=3)
    graph[decode]["inputs"]["latent"] = ["n6", 0]
    history = _wait(base, _queue(base, graph, "cross"))
    assert history["status"]["status_str"] == "success", json.dumps(history["status"]["messages"])[-4000:]
    (item,) = _mp4s(history)
    with av.open(str(work / "output" / item["subfolder"] / item["filename"])) as container:
        assert sum(1 for _ in container.decode(video=0)) == 107


def test_a_saved_latent_loads_again_in_the_next_run(server):
    """H3 Save Latent after the sampler; the file, moved to the input folder, is offered by H3 Load Latent and
    decodes to the same clip as the sampled latent did."""
    import av

    base, work = server
    graph = json.loads((PACK / "workflows" / "api" / "t2va.json").read_text())
    sampler = _node(graph, "H3Sampler")
    graph[sampler]["inputs"]["steps"] = 3
    graph["s1"] = {"class_type": "H3SaveLatent", "inputs": {"latent": [sampler, 0], "filename_prefix": "H3/kept"}}
    history = _wait(base, _queue(base, graph, "save"))
    assert history["status"]["status_str"] == "success", json.dumps(history["status"]["messages"])[-4000:]
    (saved,) = history["outputs"]["s1"]["latents"]
    (first,) = _mp4s(history)
    (work / "input").mkdir(exist_ok=True)
    shutil.copy(work / "output" / saved["subfolder"] / saved["filename"], work / "input" / "kept.safetensors")
    options = _get(f"{base}/object_info/H3LoadLatent")["H3LoadLatent"]["input"]["required"]["latent_file"]
    assert "kept.safetensors" in options[1]["options"]

    vae, decode, save = _node(graph, "H3VAELoader"), _node(graph, "H3VAEDecode"), _node(graph, "H3AVSave")
    again = {vae: graph[vae], decode: graph[decode], save: graph[save],  # no model, text encoder or sampler
             "l1": {"class_type": "H3LoadLatent", "inputs": {"latent_file": "kept.safetensors"}}}
    again[decode]["inputs"]["latent"] = ["l1", 0]
    history = _wait(base, _queue(base, again, "load"))
    assert history["status"]["status_str"] == "success", json.dumps(history["status"]["messages"])[-4000:]
    (second,) = _mp4s(history)
    frames = []
    for item in (first, second):
        with av.open(str(work / "output" / item["subfolder"] / item["filename"])) as container:
            frames.append([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])
    assert len(frames[1]) == 107 and all((a == b).all() for a, b in zip(*frames, strict=True))


def test_the_sampler_makes_the_sound_for_a_clip_it_keeps(server):
    """Frames from a core node (Empty Image, 110 of them) through H3 VAE Encode, then the sampler with keep =
    video: an MP4 of the clip's 107 frames with a generated soundtrack."""
    import av

    base, work = server
    graph = json.loads((PACK / "workflows" / "api" / "t2va.json").read_text())
    sampler = _node(graph, "H3Sampler")
    graph.update({
        "n1": {"class_type": "EmptyImage", "inputs": {"width": 224, "height": 128, "batch_size": 110, "color": 3381555}},
        "n2": {"class_type": "H3VAEEncode", "inputs": {"vae": [_node(graph, "H3VAELoader"), 0], "images": ["n1", 0],
                                                        "frame_rate": 24.0, "width": 224, "height": 128}},
    })
    graph[sampler]["inputs"].update(latent=["n2", 0], keep="video")
    history = _wait(base, _queue(base, graph, "keep"))
    assert history["status"]["status_str"] == "success", json.dumps(history["status"]["messages"])[-4000:]
    (item,) = _mp4s(history)
    with av.open(str(work / "output" / item["subfolder"] / item["filename"])) as container:
        assert sum(1 for _ in container.decode(video=0)) == 107 and container.streams.audio


def test_workflow_nodes_and_inputs_exist_in_this_comfyui(server):
    """Every node id and input name our workflow files use, against the live /object_info (the core
    nodes too, which tests/test_workflows.py can only list)."""
    base, _ = server
    info = _get(f"{base}/object_info")
    frontend_only = {"MarkdownNote", "Note"}
    problems = []
    for path in sorted((PACK / "workflows").glob("*/*.json")):
        for node_id, node in json.loads(path.read_text()).items():
            schema = info.get(node["class_type"])
            if schema is None:
                problems.append(f"{path.name} {node_id}: {node['class_type']} unknown")
                continue
            known = {**schema["input"].get("required", {}), **schema["input"].get("optional", {})}
            problems += [f"{path.name} {node_id}: {node['class_type']} has no input {name}" for name in node["inputs"]
                         if name not in known and name.split(".")[0] not in known]
    for path in TEMPLATES:
        problems += [f"{path.name}: {node['type']} unknown" for node in json.loads(path.read_text())["nodes"]
                     if node["type"] not in info and node["type"] not in frontend_only]
    assert not problems, "\n".join(problems)


# the folder each node that takes a file name lists it from (nodes/loaders.py, nodes/sampler.py; ComfyUI's input/)
FILE_FOLDERS = {"H3ModelLoader": "diffusion_models", "H3TextEncoderLoader": "text_encoders", "H3VAELoader": "vae",
                "H3LoRAApply": "loras", "LoadImage": "input", "LoadAudio": "input", "LoadVideo": "input"}


def test_real_file_templates_pass_a_real_prompt_check(server):
    """workflows/templates (the Comfy-Org file names, LoadImage / LoadAudio / LoadVideo) queue on a real /prompt
    once their files are there (empty stand-ins: the check reads names, not contents): every value in this
    ComfyUI's option lists, every input and link accepted. The runs then stop at the first file read."""
    base, work = server
    placed = []
    try:
        for path in sorted((PACK / "workflows" / "templates").glob("*.json")):
            graph = json.loads(path.read_text())
            for node in graph.values():
                folder = FILE_FOLDERS.get(node["class_type"])
                for name, value in node["inputs"].items():
                    if folder and isinstance(value, str) and "." in value and name not in ("prompt", "folder"):
                        file = work / folder / value
                        if not file.exists():
                            file.parent.mkdir(parents=True, exist_ok=True)
                            file.write_bytes(b"")
                            placed.append(file)
            status, body = _post(f"{base}/prompt", {"prompt": graph, "client_id": "templates"})
            assert status == 200 and not body.get("node_errors"), f"{path.name}: {json.dumps(body)[:3000]}"
            assert _wait(base, body["prompt_id"])["status"]["status_str"] == "error"  # an empty stand-in read
    finally:
        for file in placed:
            file.unlink(missing_ok=True)
    assert placed  # the models and media the templates name


def test_load_videos_file_video_is_read_from_its_file_with_its_trim(tmp_path, monkeypatch):
    """Our file route (H3 VAE Encode, guides, video references) leans on Load Video's VIDEO, this ComfyUI's
    VideoFromFile, answering get_stream_source() and get_active_trim_window(): checked on the real class,
    trimmed as ComfyUI trims it, against the file read directly. No server needed."""
    import importlib.util
    from fractions import Fraction

    import numpy as np
    import torch

    sys.path.insert(0, COMFYUI)
    try:
        import comfy.cli_args

        comfy.cli_args.args.cpu = True  # as the server runs here; ComfyUI's API import sets up its device
        from comfy_api.latest import InputImpl, Types
    finally:
        sys.path.remove(COMFYUI)  # ComfyUI's nodes.py would hide our nodes package
    from h3_core.media_read import read_video
    from h3_core.media_write import write_mp4

    spec = importlib.util.spec_from_file_location("h3_convert", PACK / "nodes" / "convert.py")
    convert = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "h3_convert", convert)  # its dataclasses look their module up
    spec.loader.exec_module(convert)  # pure: no ComfyUI or package-relative imports
    video_at_24fps, video_file = convert.video_at_24fps, convert.video_file

    path = tmp_path / "clip.mp4"
    frames = np.random.default_rng(2).integers(0, 256, (72, 64, 96, 3), dtype=np.uint8)
    write_mp4(path, frames, (np.sin(np.arange(32000 * 3) / 5.0) * 0.3).astype(np.float32)[None].repeat(2, 0))
    video = InputImpl.VideoFromFile(str(path))
    trimmed = video.as_trimmed(start_time=0.5, duration=1.0)
    assert video_file(video) == (str(path), 0.0, 0.0) and video_file(trimmed) == (str(path), 0.5, 1.0)
    clip, expected = video_at_24fps(trimmed, "video", 100), read_video(path, 0.5, 24)
    assert np.array_equal(clip.frames, expected.frames) and np.array_equal(clip.audio, expected.audio)
    assert video_at_24fps(video, "video", 30).frames.shape == (30, 64, 96, 3)
    # a VIDEO made from frames (Create Video) is not a file: its frames are taken as they are, never encoded to
    # H.264 in memory first (ComfyUI's default get_stream_source; x264 refuses RGBA frames and odd sizes)
    for shape in ((30, 64, 96, 4), (30, 57, 101, 3)):
        made = InputImpl.VideoFromComponents(Types.VideoComponents(torch.rand(shape), Fraction(24)))
        assert video_file(made) is None
        assert video_at_24fps(made, "video", 24).frames.shape == (24, *shape[1:3], 3)


def test_comfyuis_own_h3_vaes_read_and_write_our_latents_after_conversion(tmp_path):
    """The video latents carry over unchanged when both sides normalize with the same statistics (checked).
    The audio layout is the one part of the conversion that moves data (the stereo axis): ComfyUI's own
    MiniMaxH3AudioVAE, given the tiny ComfyUI single file our loader reads too, encodes a stereo waveform
    into what to_core_av makes of ours and decodes that to our waveform. No server needed."""
    import torch
    from safetensors.torch import load_file

    sys.path.insert(0, str(Path(__file__).parent))
    sys.path.insert(0, COMFYUI)
    try:
        import comfy.cli_args

        comfy.cli_args.args.cpu = True
        from comfy.ldm.minimax import vae as native_video
        from comfy.ldm.minimax.audio_vae import MiniMaxH3AudioVAE
    finally:
        sys.path.remove(COMFYUI)
    from audio_vae_checkpoints import TINY_AUDIO_VAE, reference_audio_vae, write_comfy_single_file

    from h3_core.output import AVLatents
    from h3_core.vae_audio_checkpoint import load_audio_vae
    from h3_core.vae_video import RELEASE_LATENTS_MEAN, RELEASE_LATENTS_STD

    # the video part moves unchanged: both normalize it with the release's statistics
    assert native_video.LATENTS_MEAN == list(RELEASE_LATENTS_MEAN)
    assert native_video.LATENTS_STD == list(RELEASE_LATENTS_STD)
    from nodes.convert import from_core_av, pack_latents, to_core_av

    path = write_comfy_single_file(tmp_path / "audio_vae.safetensors", reference_audio_vae())
    ours = load_audio_vae(path)
    native = MiniMaxH3AudioVAE(encoder_dim=TINY_AUDIO_VAE.encoder_dim, latent_dim=TINY_AUDIO_VAE.latent_dim,
                               decoder_dim=TINY_AUDIO_VAE.decoder_dim, vae_latent_channels=32).eval()
    native.load_state_dict(load_file(str(path)), strict=True)

    num_frames = 22  # 37 audio latents of 800 samples
    torch.manual_seed(0)
    waveform = torch.randn(2, 37 * 800) * 0.3
    waveform[1] *= 0.2  # left and right differ: a swapped stereo axis shows
    with torch.no_grad():
        audio = ours.encode(waveform)
        latent = pack_latents(AVLatents(torch.zeros(1, 24, 7, 2, 2), audio))
        assert latent["num_frames"] == num_frames
        core_video, core_audio = to_core_av(latent)
        native_audio = native.encode(waveform[None])
        torch.testing.assert_close(core_audio, native_audio, atol=2e-4, rtol=1e-4)
        ours_back = from_core_av(core_video, native_audio)[0]["audio"]
        torch.testing.assert_close(ours_back, audio, atol=2e-4, rtol=1e-4)
        heard = native.decode(core_audio)[0]
        torch.testing.assert_close(heard, ours.decode(audio), atol=2e-4, rtol=1e-4)
    assert (audio[0] - audio[1]).abs().max() > 0.02  # 100x the tolerance: a swapped stereo axis would show
