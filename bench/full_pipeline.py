"""The whole T2VA request at the real config with random weights: text encoder (Qwen3-VL-32B, 50
layers), DiT (33B), video VAE (decoder linears in the model dtype, as `h3 generate` runs it) and audio
VAE (fp32), in `h3 generate`'s order and memory discipline (the text encoder is released before the
DiT arrives; the VAEs wait on the CPU while the DiT samples). Timings do not depend on weight values,
so random weights time the real thing.

It calls the same engine functions as `pipeline.generate` (encode_request, sample, write_mp4); only
the checkpoint reads are replaced by building each model on the GPU. The tokenizer is the embedded
tiny one (the real one cannot be downloaded here), so the prompt's token count differs from the
release's; the count is printed. One JSON line per stage, then a summary line.

    python bench/full_pipeline.py --steps 4 --duration 5 --out /tmp/full.mp4     (GPU)
    python bench/full_pipeline.py --steps 50 --compile --linears fp8-lossy --attention-window-lossy 8   (fastest, lossy)
    python bench/full_pipeline.py --gpu-memory 24 --steps 4                        (as on a 24 GB card)
    python bench/full_pipeline.py --tiny --out /tmp/tiny.mp4                      (CPU smoke run)

`--gpu-memory GIB` caps this process's GPU memory at GIB (torch's per-process fraction: the allocator
refuses anything past it) and places the models as `h3 generate --gpu-memory GIB` does when they do not
fit: the text encoder's layers visit the GPU one at a time, the DiT keeps the blocks its memory plan
allows resident and streams the rest from pinned CPU memory. The big models are then built in CPU memory
(their values drawn on the GPU, a tensor at a time).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import shutil
import tempfile
import time
from pathlib import Path

import torch

from h3_core.conditioning import Request, encode_request
from h3_core.config import TINY_DIT, DiTConfig
from h3_core.dit import H3DiT, rope_inverse_frequencies
from h3_core.fp8 import apply_linear_mode
from h3_core.memory_plan import plan_for
from h3_core.offload import place
from h3_core.output import write_mp4
from h3_core.pipeline import TINY_CANVAS, sample
from h3_core.runtime import empty_caches
from h3_core.prompt import Presenter
from h3_core.references import RELEASE_CANVAS
from h3_core.text import TextEncoder
from h3_core.tiny import seeded_random_weights
from h3_core.text_checkpoint import QWEN3VL_32B_CONFIG, qwen3vl_config
from h3_core.tiny_text import SPECIAL_TOKENS, config_dict, write_processor, write_tokenizer
from h3_core.vae_audio import AudioVAE, AudioVAEConfig
from h3_core.vae_video import TINY_VIDEO_VAE, VideoVAE, VideoVAEConfig

GIB = 2**30
PROMPT = (
    "A red fox trots through fresh snow at dawn in a quiet pine forest. Soft golden light falls between the "
    "trunks; the camera tracks beside the fox at shoulder height, then slowly rises as it stops, lifts its head "
    "and listens. Breath steams in the cold air. Sound: crunching snow under each paw, a distant woodpecker, "
    "wind moving through the branches, and a low ambient hum of the waking forest."
)


def materialize_(model: torch.nn.Module, device: torch.device, draw_on: torch.device | None = None) -> torch.nn.Module:
    """Allocate a meta-built model on `device` with small random values (timing ignores the values);
    `draw_on`: a GPU that draws each matrix for a model held in CPU memory (much faster than the CPU)."""
    model.to_empty(device=device)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim >= 2:
                std = 1.0 / param[0].numel() ** 0.5
                if draw_on is None:
                    param.normal_(0.0, std)
                else:
                    param.copy_(torch.empty(param.shape, dtype=param.dtype, device=draw_on).normal_(0.0, std))
            else:
                param.fill_(1.0) if param.numel() > 1 else param.zero_()
    return model.eval().requires_grad_(False)


def text_encoder(folder: Path, device: torch.device, dtype: torch.dtype, tiny: bool,
                 draw_on: torch.device | None = None) -> TextEncoder:
    """Qwen3-VL cut after layer 50 (identity final norm, as the loader builds it) with the real sizes, and
    the tiny tokenizer's special-token ids so the presenter and the model agree."""
    from transformers import Qwen3VLModel

    tiny_ids = config_dict(folder, layers=50, hidden=TINY_DIT.text_dim)
    raw = copy.deepcopy(QWEN3VL_32B_CONFIG) if not tiny else tiny_ids
    for key in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        raw[key] = tiny_ids[key]
    config = qwen3vl_config(raw, 50)
    with torch.device("meta"):
        model = Qwen3VLModel(config)
    model.language_model.norm = torch.nn.Identity()
    model.to(dtype)
    materialize_(model, device, draw_on)
    for name, module in list(model.named_modules()):  # rotary tables: rebuilt from the config on the device
        if "RotaryEmbedding" in type(module).__name__:
            with torch.device(device):
                model.set_submodule(name, type(module)(module.config))
    presenter = Presenter.from_folders(folder, folder)
    assert all(presenter.tokenizer.convert_tokens_to_ids(t) is not None for t in SPECIAL_TOKENS)
    return TextEncoder(model, presenter)


def build_dit(config: DiTConfig, device: torch.device, dtype: torch.dtype,
              draw_on: torch.device | None = None) -> H3DiT:
    with torch.device("meta"):
        model = H3DiT(config)
    model.set_dtype(dtype)
    materialize_(model, device, draw_on)
    model.rope_inv_freq = rope_inverse_frequencies(config).to(device)
    return model


def host_rss_bytes() -> int:
    """This process's resident memory now (Linux /proc)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def stage(name: str, device: torch.device, work):
    """Run `work()`, print its seconds, the GPU's peak allocation during it and the process's resident host
    memory (now, and its peak so far: pinned and parked weights are host memory a smaller machine must have)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    clock = time.perf_counter()
    result = work()
    if device.type == "cuda":
        torch.cuda.synchronize()
    row = {"stage": name, "seconds": round(time.perf_counter() - clock, 3)}
    if device.type == "cuda":
        row["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 2)
        row["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved() / GIB, 2)
        row["allocated_after_gib"] = round(torch.cuda.memory_allocated() / GIB, 2)
    row["host_rss_gib"] = round(host_rss_bytes() / GIB, 2)
    row["host_peak_rss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB, 2)
    print(json.dumps(row), flush=True)
    return result, row


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true", help="tiny sizes on the CPU: proves the script runs")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--width", type=int, default=1344)
    parser.add_argument("--height", type=int, default=768)
    parser.add_argument("--out", type=Path, default=Path("/tmp/h3_full_pipeline.mp4"))
    parser.add_argument("--attention", default="auto")
    parser.add_argument("--compile", action="store_true", help="compile the repeated block (h3 generate --compile)")
    parser.add_argument("--linears", default="checkpoint", help="h3 generate --linears (e.g. fp8-lossy)")
    parser.add_argument("--attention-window-lossy", type=int, default=0, metavar="FRAMES")
    parser.add_argument("--gpu-memory", type=float, default=None, metavar="GIB",
                        help="cap the GPU at GIB and place the models as h3 generate --gpu-memory does")
    parser.add_argument("--uncapped", action="store_true",
                        help="with --gpu-memory: place the models for GIB but do not cap (how much the allocator "
                             "reserves beyond what is allocated)")
    args = parser.parse_args()
    device = torch.device("cpu" if args.tiny else "cuda")
    capped = args.gpu_memory is not None and not args.tiny
    if capped and not args.uncapped:  # the allocator refuses anything past the cap, as a smaller card would
        torch.cuda.set_per_process_memory_fraction(args.gpu_memory * GIB / torch.cuda.get_device_properties(0).total_memory)
    home, draw_on = (torch.device("cpu"), device) if capped else (device, None)
    dtype = torch.float32 if args.tiny else torch.bfloat16
    folder = Path(tempfile.mkdtemp(prefix="h3-bench-tok-"))
    write_tokenizer(folder)
    write_processor(folder, nested=True)
    width, height = (224, 128) if args.tiny else (args.width, args.height)
    request = Request("t2va", PROMPT, width=width, height=height, duration=args.duration)
    rules = TINY_CANVAS if args.tiny else RELEASE_CANVAS
    rows = []

    def build_text_encoder():
        encoder = text_encoder(folder, home, dtype, args.tiny, draw_on)
        return encoder.stream_layers(device) if capped else encoder

    encoder, row = stage("text encoder build (random, stands for the load)" + (", layers streamed" if capped else ""),
                         device, build_text_encoder)
    shutil.rmtree(folder, ignore_errors=True)  # the tokenizer and processor are loaded
    rows.append(row)
    video_config = TINY_VIDEO_VAE if args.tiny else VideoVAEConfig()
    audio_config = AudioVAEConfig(encoder_dim=4, latent_dim=64, decoder_dim=256) if args.tiny else AudioVAEConfig()
    # The VAEs get the tiny models' seeded values (finite audio: the MP4 writer refuses NaN), built on the CPU.
    video_vae = seeded_random_weights(VideoVAE(video_config), 1).set_dtype(dtype).to(device).eval().requires_grad_(False)
    audio_vae = seeded_random_weights(AudioVAE(audio_config), 2, gain=0.5).to(device).eval().requires_grad_(False)

    conditioning, row = stage("encode (text encoder)", device, lambda: encode_request(request, encoder, video_vae, audio_vae, rules=rules))
    rows.append(row)
    print(json.dumps({"text_rows": int(conditioning.text_states.shape[1]),
                      "packed_rows": int(conditioning.layout.sequence_length)}), flush=True)

    def release():
        encoder.release()
        video_vae.to("cpu"), audio_vae.to("cpu")
        empty_caches(device)  # as pipeline.generate does

    rows.append(stage("release text encoder, park VAEs", device, release)[1])
    config = TINY_DIT if args.tiny else DiTConfig()
    held = {"fp8-lossy": "fp8-scaled", "fp8-weights-lossy": "fp8"}.get(args.linears, "dense")
    plan = plan_for(config, conditioning.layout, args.steps, device, args.gpu_memory, held=held) if capped else None
    if plan is not None:
        print(json.dumps({"memory_plan": plan.describe(config.num_layers), "fits": plan.fits,
                          "planned_peak_gib": round(plan.expected_peak_bytes / GIB, 2)}), flush=True)
    dit, row = stage("DiT build (random, stands for the load)", device, lambda: build_dit(config, home, dtype, draw_on))
    rows.append(row)
    if args.linears != "checkpoint":
        apply_linear_mode(dit, args.linears, home)
    streamer = None
    if plan is not None:
        streamer, row = stage("DiT placed by its memory plan", device, lambda: place(dit, device, plan))
        rows.append(row)
    backend = dit.set_attention(args.attention, args.attention_window_lossy)
    if args.compile:
        dit.compile_blocks()
    print(json.dumps({"attention": backend, "window_frames": args.attention_window_lossy, "linears": args.linears,
                      "compile": args.compile}), flush=True)
    step_times = []
    last = [time.perf_counter()]

    def on_step(state):
        if device.type == "cuda":
            torch.cuda.synchronize()
        now = time.perf_counter()
        step_times.append(round(now - last[0], 3))
        last[0] = now

    def run_sample():
        last[0] = time.perf_counter()
        return sample(dit, conditioning, seed=0, steps=args.steps, callback=on_step,
                      offload_adaln=plan is not None and plan.offload_adaln)

    latents, row = stage(f"sample ({args.steps} steps)", device, run_sample)
    rows.append(row)
    print(json.dumps({"seconds_per_step": step_times}), flush=True)

    def release_dit():
        nonlocal dit, streamer
        if streamer is not None:
            streamer.remove()
        dit = streamer = None  # the streamer holds the resident blocks too
        empty_caches(device)  # also the pinned memory the streamed blocks waited in

    rows.append(stage("release DiT", device, release_dit)[1])

    def decode():
        video_vae.to(device), audio_vae.to(device)
        return write_mp4(args.out, latents, video_vae, audio_vae)

    rows.append(stage("decode + mux (streamed)", device, decode)[1])
    import av

    with av.open(str(args.out)) as container:
        streams = {s.type: (s.codec_context.name, getattr(s.codec_context, "sample_rate", None)) for s in container.streams}
        frames = sum(1 for _ in container.decode(video=0))
    summary = {
        "summary": "full pipeline", "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "canvas": f"{width}x{height}", "frames": int(latents.num_frames),
        "frames_in_mp4": frames, "streams": streams, "steps": args.steps,
        "gpu_memory_gib": args.gpu_memory if capped else None, "capped": capped and not args.uncapped,
        "allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "default"),
        "total_seconds": round(sum(r["seconds"] for r in rows), 2),
        "peak_allocated_gib": max((r.get("peak_allocated_gib", 0) for r in rows), default=0),
        "peak_reserved_gib": max((r.get("peak_reserved_gib", 0) for r in rows), default=0),
        "host_peak_rss_gib": max((r["host_peak_rss_gib"] for r in rows), default=0),
    }
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
