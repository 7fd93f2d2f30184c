"""The pack inside a real ComfyUI server (testing.md section 3). Needs COMFYUI_PATH (a ComfyUI tree)
and a Python that runs it (COMFYUI_PYTHON, default: the one running the tests) with this pack
installed; skips with a message otherwise. Starts the server on a free loopback port with the pack
linked into custom_nodes, checks /object_info, runs every API workflow on tiny-random, checks the MP4s."""

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

PACK = Path(__file__).resolve().parents[1]
WORKFLOWS = sorted((PACK / "workflows" / "api").glob("*.json"))
NODE_IDS = ["H3ModelLoader", "H3TextEncoderLoader", "H3VAELoader", "H3Conditioning", "H3Sampler",
            "H3LoRAApply", "H3VAEDecode", "H3AVSave"]
COMFYUI = os.environ.get("COMFYUI_PATH")

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
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


@pytest.fixture(scope="module")
def server():
    root = Path(COMFYUI)
    if not (root / "main.py").is_file():
        pytest.fail(f"COMFYUI_PATH={COMFYUI} holds no main.py")
    python = os.environ.get("COMFYUI_PYTHON", sys.executable)
    work = Path(tempfile.mkdtemp(prefix="h3-comfy-"))
    nodes_dir = work / "custom_nodes"
    nodes_dir.mkdir()
    (nodes_dir / "comfyui-h3").symlink_to(PACK, target_is_directory=True)
    config = work / "extra_model_paths.yaml"
    config.write_text(f"h3test:\n  base_path: {work}\n  custom_nodes: custom_nodes\n")
    port = _free_port()
    log = open(work / "server.log", "w")  # noqa: SIM115 (closed after the server stops)
    process = subprocess.Popen(
        [python, "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(port), "--disable-auto-launch",
         "--disable-api-nodes", "--extra-model-paths-config", str(config), "--output-directory", str(work / "output"),
         "--disable-all-custom-nodes", "--whitelist-custom-nodes", "comfyui-h3"],
        cwd=root, stdout=log, stderr=subprocess.STDOUT)
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


def test_pack_loads_and_lists_nodes(server):
    base, work = server
    info = _get(f"{base}/object_info")
    missing = [node for node in NODE_IDS if node not in info]
    assert not missing, f"not in /object_info: {missing}\n" + (work / "server.log").read_text()[-4000:]
    assert all(info[node]["category"] == "H3" for node in NODE_IDS)
    assert info["H3Sampler"]["output"] == ["H3_LATENT"]
    log = (work / "server.log").read_text()
    assert "IMPORT FAILED" not in log and "Cannot import" not in log, log[-4000:]


@pytest.mark.parametrize("workflow", WORKFLOWS, ids=[w.stem for w in WORKFLOWS])
def test_api_workflow_writes_mp4(server, workflow):
    import av

    base, work = server
    status, body = _post(f"{base}/prompt", {"prompt": json.loads(workflow.read_text()), "client_id": uuid.uuid4().hex})
    assert status == 200, body
    prompt_id = body["prompt_id"]
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        history = _get(f"{base}/history/{prompt_id}").get(prompt_id)
        if history and history.get("status", {}).get("completed") is not None or (
                history and history.get("status", {}).get("status_str") == "error"):
            break
        time.sleep(1)
    else:
        pytest.fail(f"{workflow.name} did not finish in 300 s")
    status = history["status"]
    assert status["status_str"] == "success", json.dumps(status["messages"])[-4000:]
    saved = [v for out in history["outputs"].values() for v in out.get("images", []) if v["filename"].endswith(".mp4")]
    assert len(saved) == 1, history["outputs"]
    path = work / "output" / saved[0]["subfolder"] / saved[0]["filename"]
    with av.open(str(path)) as container:
        assert sorted(s.type for s in container.streams) == ["audio", "video"]
        video, audio = container.streams.video[0], container.streams.audio[0]
        assert video.codec_context.name == "h264" and audio.codec_context.name == "aac"
        assert audio.codec_context.sample_rate == 32000
        assert sum(1 for _ in container.decode(video=0)) == 107  # 4 s -> 17n + 5 frames


def test_bad_prompt_is_a_node_error_and_server_goes_on(server):
    base, _ = server
    graph = json.loads((PACK / "workflows" / "api" / "t2va.json").read_text())
    graph["5"]["inputs"]["steps"] = 10_000  # above the schema's max
    status, body = _post(f"{base}/prompt", {"prompt": graph, "client_id": "x"})
    assert status == 400 and "5" in body.get("node_errors", {}), body
    assert "H3Sampler" in _get(f"{base}/object_info/H3Sampler")
