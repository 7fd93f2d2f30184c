"""Every H3 task as a ComfyUI graph, stated once and written two ways:

- `workflows/api/<name>.json`: API-format prompts on the embedded tiny-random model with generated media
  (EmptyImage, EmptyAudio, CreateVideo), 2 steps, 4 s: what scripts POST to /prompt and what the
  real-server test runs on the CPU.
- `workflows/templates/<name>.json`: the same graph for real use (Comfy-Org file names, LoadImage /
  LoadAudio / LoadVideo, automatic steps, 5 s), still in API format; tools/canvas.mjs loads each into the
  ComfyUI canvas and saves the canvas (UI-format) workflow as `example_workflows/<name>.json`, which
  ComfyUI's template browser lists under this pack.

Run: python tools/workflows.py   (then node tools/canvas.mjs for the canvas files, see its docstring, and this
again: it names each loader's files, with their download links, in the canvas files' node properties)
Every task's graph; t2va_guides: an image and a sound anchored mid-clip (H3 Add Guide); long_video:
t2va over 20 s in two continuation windows; long_video_guides: the same with an image at the start, one
at 12.5 s (the second window) and a sound in the last 2.5 s (H3 Continuation Guide); extend_video: a
t2va clip sampled, then extended to 15 s by H3 Continuation (continue_from); extend_my_video: a video of
your own (H3 VAE Encode) extended the same way; sound_for_my_video: the sound made for a video of your own
(H3 Continuation's keep_video), window by window; video_for_my_sound: a video made to a sound of your own (H3
Continuation's drive_audio), as long as the sound.
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = ("A red fox trots along a beach at sunset; waves crash softly, gulls call, and a woman laughs "
          "somewhere behind the camera.")
MUSIC_VIDEO_PROMPT = ("A music video: a dancer in a red coat moves to the beat on a rain-soaked rooftop at night, "
                      "city lights behind her, the camera circling slowly.")
SOUND_PROMPT = ("The sound of this scene as it happens: footsteps, wind and the world around the camera, with "
                "no music.")
TURBO_LORA = "minimax_h3_fl2v_turbo_8step_v1.0_comfyui_bf16.safetensors"
# The files ComfyUI's own H3 templates use (comfyui-workflow-templates' video_minimax_h3_*), so a user who has
# run those has them: the pruned int8 DiTs (~20 GB), the NVFP4 text encoder (~15 GiB, whole on a 24 GB card)
REAL = {  # Comfy-Org/MiniMax-H3 file names (models/diffusion_models, text_encoders, vae)
    "fl2va": "minimax_h3_fl2va_pruned_int8_convrot.safetensors",
    "ref2va": "minimax_h3_ref2va_pruned_int8_convrot.safetensors",
    "text_encoder": "qwen3vl_32b_minimax_h3_nvfp4_awq.safetensors",
    "video_vae": "minimax_h3_video_vae_fp16.safetensors",
    "audio_vae": "minimax_h3_audio_vae_fp32.safetensors",
}
HUB = "https://huggingface.co/Comfy-Org/MiniMax-H3/resolve/main"
# file -> (ComfyUI model folder, download URL), as ComfyUI's own H3 templates link them
DOWNLOADS = {
    REAL["fl2va"]: ("diffusion_models", f"{HUB}/diffusion_models/{REAL['fl2va']}"),
    REAL["ref2va"]: ("diffusion_models", f"{HUB}/diffusion_models/{REAL['ref2va']}"),
    REAL["text_encoder"]: ("text_encoders", f"{HUB}/text_encoders/{REAL['text_encoder']}"),
    REAL["video_vae"]: ("vae", f"{HUB}/vae/{REAL['video_vae']}"),
    REAL["audio_vae"]: ("vae", f"{HUB}/vae/{REAL['audio_vae']}"),
    TURBO_LORA: ("loras", f"https://huggingface.co/lightx2v/Minimax-h3-Turbo/resolve/main/{TURBO_LORA}"),
}

# name: (task, keyframes, references, turbo); references are "image" | "video" | "audio" in slot order
TASKS = {
    "t2va": ("t2va", (), (), False),
    "t2va_turbo": ("t2va", (), (), True),
    "fl2va_first": ("fl2va", ("first",), (), False),
    "fl2va_last": ("fl2va", ("last",), (), False),
    "fl2va_first_last": ("fl2va", ("first", "last"), (), False),
    "ref2va_images": ("ref2va", (), ("image", "image"), False),
    "ref2va_image_audio": ("ref2va", (), ("image", "audio"), False),
    "ref2va_video": ("ref2va", (), ("video",), False),
    "t2va_guides": ("t2va", (), (), False),
}
# name: H3 Add Guide nodes after H3 Conditioning, (frame index, "image" | "audio") in chain order
GUIDES = {"t2va_guides": ((60, "image"), (24, "audio"))}


class Graph:
    def __init__(self):
        self.nodes: dict[str, dict] = {}

    def add(self, class_type: str, **inputs) -> str:
        node_id = str(len(self.nodes) + 1)
        self.nodes[node_id] = {"class_type": class_type, "inputs": inputs}
        return node_id


def _image(graph: Graph, real: bool, what: str, color: int) -> list:
    if real:
        return [graph.add("LoadImage", image=f"h3_{what}.png"), 0]
    return [graph.add("EmptyImage", width=224, height=128, batch_size=1, color=color), 0]


def _audio(graph: Graph, real: bool, what: str) -> list:
    if real:
        return [graph.add("LoadAudio", audio=f"h3_{what}.wav"), 0]
    return [graph.add("EmptyAudio", duration=3.0, sample_rate=32000, channels=2), 0]


def _video(graph: Graph, real: bool, what: str, frames: int = 60) -> list:
    """A video of the user's (real) or `frames` frames of one colour at 24 fps with silence (tiny)."""
    if real:
        return [graph.add("LoadVideo", file=f"h3_{what}.mp4"), 0]
    images = graph.add("EmptyImage", width=224, height=128, batch_size=frames, color=3355647)
    sound = graph.add("EmptyAudio", duration=frames / 24, sample_rate=32000, channels=2)
    return [graph.add("CreateVideo", images=[images, 0], fps=24.0, audio=[sound, 0]), 0]


def _loaders(graph: Graph, real: bool, partition: str = "fl2va") -> tuple[str, str, str]:
    """The three loaders: the Comfy-Org files (real) or tiny-random."""
    tiny = "tiny-random"
    model = graph.add("H3ModelLoader", checkpoint=REAL[partition] if real else tiny, folder="", partition=partition,
                      weight_dtype="bf16", attention="auto")
    text = graph.add("H3TextEncoderLoader", text_encoder=REAL["text_encoder"] if real else tiny, folder="",
                     tokenizer_folder="", weight_dtype="bf16")
    vae = graph.add("H3VAELoader", video_vae=REAL["video_vae"] if real else tiny,
                    audio_vae=REAL["audio_vae"] if real else tiny, folder="", weight_dtype="bf16")
    return model, text, vae


def build(name: str, real: bool) -> dict:
    task, keyframes, references, turbo = TASKS[name]
    partition = "ref2va" if task == "ref2va" else "fl2va"
    g = Graph()
    model, text, vae = _loaders(g, real, partition)
    model_out = [model, 0]
    if turbo:
        model_out = [g.add("H3LoRAApply", model=model_out, lora_name=TURBO_LORA, strength=1.0), 0]
    cond_inputs = dict(text_encoder=[text, 0], vae=[vae, 0], prompt=PROMPT, task=task, aspect_ratio="auto",
                       width=0, height=0, duration=5.0 if real else 4.0)
    for anchor, color in zip(keyframes, (16744448, 2113663)):
        cond_inputs[f"{anchor}_image"] = _image(g, real, f"{anchor}_frame", color)
    for index, kind in enumerate(references):
        make = {"image": lambda: _image(g, real, f"reference_{index}", 16744448 - 4000 * index),
                "audio": lambda: _audio(g, real, f"reference_{index}"),
                "video": lambda: _video(g, real, f"reference_{index}")}[kind]
        cond_inputs[f"references.ref{index}"] = make()
    cond = g.add("H3Conditioning", **cond_inputs)
    cond_out = [cond, 0]
    for index, (frame, kind) in enumerate(GUIDES.get(name, ())):
        media = _image(g, real, f"guide_{index}", 8421504) if kind == "image" else _audio(g, real, f"guide_{index}")
        cond_out = [g.add("H3AddGuide", conditioning=cond_out, vae=[vae, 0], frame_index=frame, **{kind: media}), 0]
    latent = g.add("H3EmptyAVLatent", width=1344, height=768, num_frames=124, conditioning=[cond, 0])
    sampler = g.add("H3Sampler", model=model_out, conditioning=cond_out, latent=[latent, 0], seed=0,
                    steps=0 if real else 2, video_shift=0.0, audio_shift=0.0, denoise=1.0, outputs=1)
    decode = g.add("H3VAEDecode", vae=[vae, 0], latent=[sampler, 0], tiling="release", devices="")
    g.add("H3AVSave", images=[decode, 0], audio=[decode, 1], filename_prefix=f"H3/{name}")
    return g.nodes


LONG_VIDEO_GUIDES = ((0, "image"), (300, "image"), (-60, "audio"))
# one line a window, each saying the sound too: with window prompts, H3 Continuation's prompt box is not sampled
LONG_VIDEO_PROMPTS = ("A red fox trots along the waterline of a beach at sunset; waves crash softly and gulls call.\n"
                      "The fox breaks into a run as the sun sets; its paws thud on wet sand over the waves and gulls.")


def build_long_video(real: bool, guides=()) -> dict:
    """t2va over 20 s in two continuation windows, each with its own prompt, decoded straight into an MP4;
    `guides` (frame, kind) chained through H3 Continuation Guide."""
    g = Graph()
    model, text, vae = _loaders(g, real)
    chain = {}
    for index, (frame, kind) in enumerate(guides):
        media = (_image(g, real, f"long_guide_{index}", 8421504 + 5000 * index) if kind == "image"
                 else _audio(g, real, f"long_guide_{index}"))
        chain = {"guides": [g.add("H3ContinuationGuide", frame_index=frame, **{kind: media}, **chain), 0]}
    latent = g.add("H3Continuation", model=[model, 0], text_encoder=[text, 0], vae=[vae, 0], **chain,
                   prompt="", task="t2va", duration=20.0, mode="continuation", window_frames=277, overlap_frames=22,
                   seed=0, steps=0 if real else 2, video_shift=0.0, audio_shift=0.0, aspect_ratio="auto", width=0,
                   height=0, window_prompts=LONG_VIDEO_PROMPTS)
    g.add("H3SaveMP4", vae=[vae, 0], latent=[latent, 0], filename_prefix="H3/long_video" + ("_guides" * bool(guides)),
          tiling="release", devices="")
    return g.nodes


def build_extend_video(real: bool) -> dict:
    """A t2va clip from H3 Dual-Clock Sampler, saved, then extended to 15 s (kept as it is, continued from its
    tail) and saved again."""
    g = Graph()
    model, text, vae = _loaders(g, real)
    cond = g.add("H3Conditioning", text_encoder=[text, 0], vae=[vae, 0], prompt=PROMPT, task="t2va",
                 aspect_ratio="auto", width=0, height=0, duration=5.0 if real else 4.0)
    latent = g.add("H3EmptyAVLatent", width=1344, height=768, num_frames=124, conditioning=[cond, 0])
    clip = g.add("H3Sampler", model=[model, 0], conditioning=[cond, 0], latent=[latent, 0], seed=0,
                 steps=0 if real else 2, video_shift=0.0, audio_shift=0.0, denoise=1.0, outputs=1)
    g.add("H3SaveMP4", vae=[vae, 0], latent=[clip, 0], filename_prefix="H3/extend_first", tiling="release",
          devices="")
    longer = g.add("H3Continuation", model=[model, 0], text_encoder=[text, 0], vae=[vae, 0], continue_from=[clip, 0],
                   prompt="The fox slows to a walk and looks out to sea as the light fades.", task="t2va",
                   duration=15.0 if real else 8.0, mode="continuation", window_frames=277, overlap_frames=22,
                   seed=0, steps=0 if real else 2, video_shift=0.0, audio_shift=0.0, aspect_ratio="auto", width=0,
                   height=0, window_prompts="")
    g.add("H3SaveMP4", vae=[vae, 0], latent=[longer, 0], filename_prefix="H3/extend_video", tiling="release",
          devices="")
    return g.nodes


def build_extend_my_video(real: bool) -> dict:
    """A video of your own (H3 VAE Encode) extended to 15 s by H3 Continuation and saved."""
    g = Graph()
    model, text, vae = _loaders(g, real)
    clip = g.add("H3VAEEncode", vae=[vae, 0], video=_video(g, real, "my_clip"), width=0, height=0)
    longer = g.add("H3Continuation", model=[model, 0], text_encoder=[text, 0], vae=[vae, 0], continue_from=[clip, 0],
                   prompt=PROMPT, task="t2va", duration=15.0 if real else 5.0, mode="continuation",
                   window_frames=277, overlap_frames=22, seed=0, steps=0 if real else 2, video_shift=0.0,
                   audio_shift=0.0, aspect_ratio="auto", width=0, height=0, window_prompts="")
    g.add("H3SaveMP4", vae=[vae, 0], latent=[longer, 0], filename_prefix="H3/extend_my_video", tiling="release",
          devices="")
    return g.nodes


def build_sound_for_my_video(real: bool) -> dict:
    """The sound for a video of your own (H3 VAE Encode), made window by window while its video is kept."""
    g = Graph()
    model, text, vae = _loaders(g, real)
    clip = g.add("H3VAEEncode", vae=[vae, 0], video=_video(g, real, "my_clip", frames=130), width=0, height=0)
    sound = g.add("H3Continuation", model=[model, 0], text_encoder=[text, 0], vae=[vae, 0], keep_video=[clip, 0],
                  prompt=SOUND_PROMPT, task="t2va", duration=300.0, mode="continuation",
                  window_frames=277 if real else 107,  # tiny: 124 frames in two windows
                  overlap_frames=22, seed=0, steps=0 if real else 2, video_shift=0.0, audio_shift=0.0,
                  aspect_ratio="auto", width=0, height=0, window_prompts="")
    g.add("H3SaveMP4", vae=[vae, 0], latent=[sound, 0], filename_prefix="H3/sound_for_my_video", tiling="release",
          devices="")
    return g.nodes


def build_video_for_my_sound(real: bool) -> dict:
    """A video made to a sound of your own (a song, a voice-over) by H3 Continuation's drive_audio, window by
    window, as long as the sound (the duration reaches past its end)."""
    g = Graph()
    model, text, vae = _loaders(g, real)
    song = [g.add("LoadAudio", audio="h3_my_song.wav"), 0] if real else [
        g.add("EmptyAudio", duration=6.0, sample_rate=32000, channels=2), 0]  # tiny: 141 frames in two windows
    clip = g.add("H3Continuation", model=[model, 0], text_encoder=[text, 0], vae=[vae, 0], drive_audio=song,
                 prompt=MUSIC_VIDEO_PROMPT, task="t2va", duration=300.0, mode="continuation",
                 window_frames=277 if real else 107, overlap_frames=22, seed=0, steps=0 if real else 2,
                 video_shift=0.0, audio_shift=0.0, aspect_ratio="auto", width=0, height=0, window_prompts="")
    g.add("H3SaveMP4", vae=[vae, 0], latent=[clip, 0], filename_prefix="H3/video_for_my_sound", tiling="release",
          devices="")
    return g.nodes


def link_models(canvas: dict) -> dict:
    """Name each node's files in its `properties.models` (file, folder, URL): ComfyUI's frontend offers to
    download the ones a node selects (a widget value) that the user does not have."""
    for node in canvas["nodes"]:
        files = [value for value in node.get("widgets_values") or [] if isinstance(value, str) and value in DOWNLOADS]
        if files:
            node.setdefault("properties", {})["models"] = [
                {"name": name, "url": DOWNLOADS[name][1], "directory": DOWNLOADS[name][0]} for name in files]
    return canvas


def main() -> None:
    for folder, real in (("api", False), ("templates", True)):
        out = ROOT / "workflows" / folder
        out.mkdir(parents=True, exist_ok=True)
        for name in TASKS:
            (out / f"{name}.json").write_text(json.dumps(build(name, real), indent=2) + "\n")
        (out / "long_video.json").write_text(json.dumps(build_long_video(real), indent=2) + "\n")
        guided = build_long_video(real, LONG_VIDEO_GUIDES)
        (out / "long_video_guides.json").write_text(json.dumps(guided, indent=2) + "\n")
        (out / "extend_video.json").write_text(json.dumps(build_extend_video(real), indent=2) + "\n")
        (out / "extend_my_video.json").write_text(json.dumps(build_extend_my_video(real), indent=2) + "\n")
        (out / "sound_for_my_video.json").write_text(json.dumps(build_sound_for_my_video(real), indent=2) + "\n")
        (out / "video_for_my_sound.json").write_text(json.dumps(build_video_for_my_sound(real), indent=2) + "\n")
    print(f"wrote {len(TASKS) + 6} API prompts to workflows/api and workflows/templates")
    canvases = sorted((ROOT / "example_workflows").glob("*.json"))  # what tools/canvas.mjs made of the templates
    for path in canvases:
        path.write_text(json.dumps(link_models(json.loads(path.read_text())), indent=2, ensure_ascii=False) + "\n")
    print(f"linked the models of {len(canvases)} canvas workflows in example_workflows")


if __name__ == "__main__":
    main()
