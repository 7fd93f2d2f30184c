"""H3 Model Loader, H3 Text Encoder Loader, H3 VAE Loader: files from ComfyUI's model folders (or an
original release / partition folder, or `tiny-random`) -> handles on our own sockets."""

from __future__ import annotations

import weakref
from pathlib import Path

import torch
from comfy_api.latest import io

from h3_core.attention import EXACT_BACKENDS, LOSSY_BACKENDS, resolve_backend
from h3_core.checkpoint import DiTReader, locate_dit, vsa_student, with_config
from h3_core.fp8 import LINEAR_MODES, apply_linear_mode, check_linear_mode
from h3_core.gguf_file import GGUF_SUFFIX
from h3_core.local_attention import check_setting as check_window_setting
from h3_core.memory_plan import check_budget
from h3_core.parallel import ModelSpec
from h3_core.placement import freed_on_failure, module_bytes
from h3_core.pipeline import MODEL_DTYPES, TINY_CANVAS
from h3_core.references import RELEASE_CANVAS
from h3_core.text import (
    ENCODING_FLOOR_BYTES,
    load_text_encoder,
    locate_text_encoder_files,
    text_encoder_bytes,
    text_encoder_presenter,
)
from h3_core.text_mmproj import MARKER as MMPROJ_MARKER
from h3_core.text_mmproj import companions as mmproj_companions
from h3_core.tiny import (
    TINY_RANDOM,
    tiny_model_dtype,
    tiny_random_audio_vae,
    tiny_random_dit,
    tiny_random_video_vae,
)
from h3_core.tiny_text import tiny_random_text_encoder
from h3_core.vae_audio_checkpoint import check_audio_vae, load_audio_vae
from h3_core.vae_video_checkpoint import check_video_vae, load_video_vae

from .common import (
    CATEGORY,
    DTYPES,
    H3VAE,
    H3Model,
    H3TextEncoder,
    device,
    device_list,
    files_fingerprint,
    model_choices,
    progress_and_interrupt,
    vae_device,
)
from .convert import DiTRunSettings, ModelHandle, TextEncoderHandle, VAEHandle
from .host_memory import warn_unless_room
from .memory import (
    make_room,
    manage,
    manage_dit,
    manage_runner,
    manage_text_encoder,
    streamed_text_encoder_home,
    text_encoder_streams,
)
from .model_folders import chosen_file, clean_path, folder_problem, model_path, typed_path

FOLDER_TOOLTIP = ("Optional: a folder of the original release (its root or a partition folder such as FL2VA/), or "
                  "the path of an all-in-one file. When set it is used instead of the file chosen above. It must lie "
                  "in ComfyUI's model folders (a relative path is looked for there) unless ComfyUI was started with "
                  "H3_ALLOW_ANY_FOLDER=1.")


class H3ModelLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3ModelLoader",
            display_name="H3 Model Loader",
            category=CATEGORY,
            description="Loads the MiniMax-H3 diffusion transformer (one partition) with the H3 engine. The file is "
                        "checked now; its weights are read at the first run, once the prompt is encoded (split over "
                        "devices, its worker processes read their shares now).",
            inputs=[
                io.Combo.Input("checkpoint", options=model_choices("diffusion_models", also=(GGUF_SUFFIX,)),
                               default=TINY_RANDOM,
                               tooltip="A file from models/diffusion_models (Comfy-Org names work; GGUF files too, "
                                       "their quantized linears kept so), or tiny-random: a small random model for "
                                       "tests and demos."),
                io.String.Input("folder", default="", tooltip=FOLDER_TOOLTIP),
                io.Combo.Input("partition", options=["fl2va", "ref2va"], default="fl2va",
                               tooltip="fl2va serves t2va and fl2va (first/last frame); ref2va serves references."),
                io.Combo.Input("weight_dtype", options=list(DTYPES), default="bf16",
                               tooltip="Weight dtype (the release policy keeps projections and heads in fp32); "
                                       "'checkpoint' keeps each tensor's stored dtype (a GGUF file's DiT: bf16)."),
                io.Combo.Input("attention", options=["auto", *EXACT_BACKENDS, *LOSSY_BACKENDS], default="auto",
                               tooltip="Attention kernel: auto picks the fastest exact one installed (FlashAttention 3 or 4 on "
                                       "Hopper/Blackwell for a bf16 / fp16 DiT, else torch's SDPA); sage and the *-lossy ones trade "
                                       "accuracy for speed and are only used when picked."),
                io.Float.Input("gpu_memory_gb", default=0.0, min=0.0, max=4096.0, step=0.5, optional=True,
                               tooltip="GPU memory the DiT may use, in GiB; 0 = automatic: what ComfyUI has free once "
                                       "other models have left. What does not fit (the bf16 DiT is 62 GiB) streams "
                                       "from pinned CPU memory block by block each step: slower, same result. Set "
                                       "it to leave room for other work or to force streaming."),
                io.String.Input("devices", default="", optional=True,
                                tooltip="Empty: ComfyUI's device. Two or more, comma-separated (e.g. cuda:0,cuda:1): "
                                        "the DiT is split over them in worker processes (sequence parallel; the count "
                                        "must divide the 56 attention heads: 2, 4, 7 or 8). Text encoder and VAEs "
                                        "stay on ComfyUI's device. Unloading the model stops the workers. Linux "
                                        "only (the workers talk over NCCL, which Windows and macOS torch lack)."),
                io.Boolean.Input("shard_weights", default=False, optional=True,
                                 tooltip="With devices: each device keeps 1/N of every block's weights and gathers a "
                                         "block just before it runs (e.g. four 24 GB cards); else each holds the "
                                         "whole DiT."),
                io.Boolean.Input("compile", default=False, optional=True,
                                 tooltip="torch.compile the repeated block: about 10% faster per step on an H200 once "
                                         "the first run has paid the compile (tens of seconds; later canvases, durations "
                                         "and prompts reuse it); not bitwise exact. Blocks carrying a LoRA run "
                                         "uncompiled."),
                io.Int.Input("attention_window_lossy", default=0, min=0, max=256, optional=True,
                             tooltip="Lossy speed-up, 0 = off (full attention, as the model was trained). N > 0: "
                                     "each video token attends only the video within N latent frames (about 3.4 "
                                     "frames each) of itself, plus all text, keyframes, references and audio. With FlashAttention 3 (a build with "
                                     "sliding-window kernels) 8 frames took a compiled 5 s forward from 5.6 to 3.8 s on an H200; "
                                     "what it costs in quality depends on the clip: compare before relying on it."),
                io.Int.Input("attention_window_dense_steps", default=0, min=0, max=1000, optional=True,
                             tooltip="With attention_window_lossy: the first N steps of every sampling run keep full "
                                     "attention (the noisiest steps set the layout; sparse-attention speed-ups for "
                                     "video models commonly keep ~20% of the steps dense). 0: windowed from the start."),
                io.Combo.Input("linears", options=list(LINEAR_MODES), default="checkpoint", optional=True,
                               tooltip="How the blocks' linear weights are held. checkpoint: as stored (an fp8_scaled "
                                       "file's stay FP8, an int8 / int4 / nvfp4 / GGUF file's so). dense: such a "
                                       "file dequantized at load. fp8-weights-lossy: quantized to FP8 at load (per "
                                       "output channel), computed in the model dtype: the bf16 DiT's block weights go "
                                       "from 38 to 19 GB, so fewer stream on a small GPU (an int8, int4, nvfp4 or "
                                       "GGUF file's stay as they are). fp8-lossy: FP8 matmuls too (Ada / Hopper; an "
                                       "e5m2, int8, int4, nvfp4 or GGUF file's block weights are requantized to "
                                       "e4m3), "
                                       "about 10% faster per step on an H200. The two *-lossy modes change the "
                                       "output slightly (fp8-lossy: video cosine 0.9976 against bf16 on random weights)."),
            ],
            outputs=[H3Model.Output(display_name="model",
                                    tooltip="The H3 DiT of the chosen partition: connect to H3 Dual-Clock Sampler, "
                                            "H3 Continuation, or H3 LoRA / Turbo Apply first.")],
        )

    @classmethod
    def validate_inputs(cls, folder=None) -> bool | str:
        """A folder outside ComfyUI's model folders is refused at queue time."""
        return folder_problem(folder, "diffusion_models") or True

    @classmethod
    def fingerprint_inputs(cls, checkpoint=None, folder="", **_) -> str:
        """The chosen file (or folder) as it is on disk now: saved over, it loads again."""
        path = chosen_file("diffusion_models", checkpoint, folder)
        return files_fingerprint(path) if path else ""

    @classmethod
    def execute(cls, checkpoint, folder, partition, weight_dtype, attention, gpu_memory_gb=0.0, devices="",
                shard_weights=False, compile=False, attention_window_lossy=0,
                attention_window_dense_steps=0, linears="checkpoint") -> io.NodeOutput:
        split = split_devices(devices, shard_weights, gpu_memory_gb)
        target = split[0] if split else device()
        # NaN passes ComfyUI's range check; more than the GPU has: both refused before any read
        check_budget(float(gpu_memory_gb) or None, target)
        window, dense_steps = check_window_setting(int(attention_window_lossy or 0),
                                                   int(attention_window_dense_steps or 0))
        # an unavailable kernel (or one that cannot run the window), or FP8 matmuls the device lacks, fail
        # before any weight is read
        dtype = DTYPES[weight_dtype]
        resolve_backend(attention, target, window=window > 0, dtype=dtype)  # None ("checkpoint"): checked again below
        check_linear_mode(linears, target)
        tiny = checkpoint == TINY_RANDOM and not clean_path(folder)
        path = None if tiny else model_path("diffusion_models", checkpoint, folder)
        label = f"H3 DiT ({partition}, {TINY_RANDOM if tiny else Path(path).name})"
        if tiny:
            dtype = tiny_model_dtype(target, dtype)
        source = None if tiny else with_config(locate_dit(path, partition))  # headers read once, here
        student = not tiny and vsa_student(source)
        if student and window:
            raise ValueError("This DiT carries Video Sparse Attention gates (FastH3 8-Step V2): its attention is sparse "
                             "already; clear attention_window_lossy.")
        if split:
            spec = ModelSpec(TINY_RANDOM if tiny else str(path), partition, dtype, attention, linears=linears,
                             compile=bool(compile), attention_window=window, attention_window_dense_steps=dense_steps)
            patcher = manage_runner(label, spec, split, bool(shard_weights))
            return io.NodeOutput(ModelHandle(patcher.model, partition, spec.source, target, tiny, patcher=patcher))
        weights = (str(path or TINY_RANDOM), files_fingerprint(path) if path else "", partition, dtype, linears, str(target))
        patcher = _SHARED_DITS.get(weights)  # a live loader output holding these weights, if any
        reader = None
        if patcher is not None:
            dit = patcher.model.dit
        elif tiny:
            dit = tiny_random_dit(dtype, target)
            apply_linear_mode(dit, linears, target)
        else:  # headers only: the weights are read at the first run, once the prompt is encoded
            reader = DiTReader(source, partition, dtype, linears=linears, device=target)
            dit = reader.model
        # the kernel for what the DiT computes in, known now (a file read as stored may hold fp32, which
        # FlashAttention cannot run); kernel, window, compile and budget are applied at each run (chosen for the
        # compute device; a student's VSA is on; compiled blocks are traced at the first run, streaming hooks
        # running around them)
        chosen = resolve_backend(attention, target, window=window > 0, dtype=dit.attention_dtype)
        run = DiTRunSettings(chosen, window, dense_steps, bool(compile), float(gpu_memory_gb) or None)
        dit.set_attention(chosen, window, dense_steps)
        if patcher is None:
            patcher = manage_dit(label, dit, target, tiny, run.budget_gib, reader)
            _SHARED_DITS[weights] = patcher
        return io.NodeOutput(ModelHandle(dit, partition, str(path or TINY_RANDOM), target, tiny, patcher=patcher, run=run))


# The DiTs that loader outputs hold, by what fixes their weights (file as it is on disk, partition, dtype, linears,
# device): a loader differing only in run settings shares one, rather than reading the weights again.
_SHARED_DITS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def split_devices(devices: str, shard_weights: bool, gpu_memory_gb: float) -> list[torch.device]:
    """The loader's `devices` text as a list (empty: ComfyUI's one device); a bad combination is refused."""
    parsed = device_list(devices, "split the DiT over them")
    if shard_weights and not parsed:
        raise ValueError("shard_weights splits the DiT's weights over several devices: list them in devices.")
    if parsed and gpu_memory_gb:
        raise ValueError("gpu_memory_gb streams blocks on one device; with several devices leave it at 0 (each "
                         "holds the whole DiT, or 1/N of it with shard_weights).")
    return parsed


class H3TextEncoderLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3TextEncoderLoader",
            display_name="H3 Text Encoder Loader",
            category=CATEGORY,
            description="Loads H3's Qwen3-VL text conditioner (layer 50 hidden states).",
            inputs=[
                io.Combo.Input("text_encoder", options=model_choices("text_encoders", also=(GGUF_SUFFIX,),
                                                                     unless=MMPROJ_MARKER),
                               default=TINY_RANDOM,
                               tooltip="A file from models/text_encoders (e.g. qwen3vl_32b_minimax_h3_bf16, or a GGUF "
                                       "of Qwen3-VL-32B's language model, whose vision tower for keyframes and "
                                       "references is read from the mmproj GGUF file beside it; without one it "
                                       "encodes prompts only), or tiny-random for tests and demos."),
                io.String.Input("folder", default="", tooltip=FOLDER_TOOLTIP),
                io.String.Input("tokenizer_folder", default="",
                                tooltip="For a single file, which carries none: the release's FL2VA/tokenizer folder "
                                        "(or FL2VA/). Empty: the release's, fetched once from the Hugging Face Hub "
                                        "(MiniMaxAI/MiniMax-H3, about 7 MiB) into its cache. Like folder, it must lie in "
                                        "ComfyUI's model folders."),
                io.Combo.Input("weight_dtype", options=list(MODEL_DTYPES), default="bf16",
                               tooltip="dtype the encoder runs in."),
                io.Float.Input("gpu_memory_gb", default=0.0, min=0.0, max=4096.0, step=0.5, optional=True,
                               tooltip="GPU memory the text encoder may use, in GiB; 0 = automatic: what ComfyUI "
                                       "has free once other models have left. When the encoder does not fit (48 GiB "
                                       "in bf16, 25 GiB from the int8 file, 15 GiB from the nvfp4 one, plus about 2 GiB "
                                       "while it encodes) its weights stay in CPU memory "
                                       "and each decoder layer visits the GPU only while it runs: same result, a "
                                       "few seconds slower per prompt. Set it to force that on a busy GPU."),
            ],
            outputs=[H3TextEncoder.Output(display_name="text_encoder",
                                          tooltip="The loaded Qwen3-VL text encoder: connect to H3 Conditioning's or H3 "
                                                  "Continuation's text_encoder.")],
        )

    @classmethod
    def validate_inputs(cls, folder=None, tokenizer_folder=None) -> bool | str:
        """A folder outside ComfyUI's model folders is refused at queue time."""
        return folder_problem(folder, "text_encoders") or folder_problem(tokenizer_folder, "text_encoders") or True

    @classmethod
    def fingerprint_inputs(cls, text_encoder=None, folder="", tokenizer_folder="", weight_dtype="bf16",
                           gpu_memory_gb=0.0) -> str:
        """The chosen file (or folder) as it is on disk now, a GGUF encoder's vision tower (whichever mmproj
        file lies beside it) and the tokenizer folder's files. One saved over, added or removed loads the encoder
        again (ComfyUI would hand the cached one on). A linked name or folder (None here) is not followed:
        anything but a text would make every run load the encoder again."""
        path = chosen_file("text_encoders", text_encoder, folder)
        if not path:
            return ""
        try:
            gguf = Path(path).is_file() and Path(path).suffix.lower() == GGUF_SUFFIX
            typed = typed_path(tokenizer_folder, "text_encoders") if isinstance(tokenizer_folder, str) else ""
            tokenizer = [typed] if typed else []
            return files_fingerprint(path, *(mmproj_companions(Path(path)) if gguf else ()), *tokenizer)
        except (OSError, ValueError):  # unreadable: execute says so
            return ""

    @classmethod
    def execute(cls, text_encoder, folder, tokenizer_folder, weight_dtype, gpu_memory_gb=0.0) -> io.NodeOutput:
        target = device()
        budget = float(gpu_memory_gb) or None
        check_budget(budget, target)  # NaN passes ComfyUI's range check; more than the GPU has: refused now
        if text_encoder == TINY_RANDOM and not clean_path(folder):  # tiny: fits anywhere unless a budget says not
            encoder, name, canvas = tiny_random_text_encoder(device="cpu"), TINY_RANDOM, TINY_CANVAS
            stream = bool(budget) and text_encoder_streams(encoder.resident_bytes + ENCODING_FLOOR_BYTES, target,
                                                           budget)
            if not stream:
                encoder.to(target)
        else:
            path = model_path("text_encoders", text_encoder, folder)
            tokenizer = typed_path(tokenizer_folder, "text_encoders") or None
            # a missing, damaged or mismatched tokenizer is refused before room is made (a single file's, if none
            # is given, is fetched)
            found = locate_text_encoder_files(path, tokenizer)
            text_encoder_presenter(found)
            dtype = DTYPES[weight_dtype]
            weight_bytes = text_encoder_bytes(path, dtype)
            stream = text_encoder_streams(weight_bytes + ENCODING_FLOOR_BYTES, target, budget)
            home = streamed_text_encoder_home(target) if stream else target  # streamed layers wait in CPU memory
            if stream:  # our other models may let go of CPU memory for it (host_memory)
                warn_unless_room(weight_bytes, "The text encoder")
            with freed_on_failure(target):
                encoder = load_text_encoder(path, dtype, home, tokenizer=found.tokenizer_folder,
                                            processor=found.processor_folder, on_tensor=progress_and_interrupt())
            name, canvas = str(path), RELEASE_CANVAS
        patcher = manage_text_encoder(f"H3 text encoder ({Path(name).name})", encoder, target, stream, budget)
        return io.NodeOutput(TextEncoderHandle(encoder, name, canvas, patcher=patcher))


class H3VAELoader(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        choices = model_choices("vae")
        return io.Schema(
            node_id="H3VAELoader",
            display_name="H3 VAE Loader",
            category=CATEGORY,
            description="Loads H3's video VAE and audio VAE together.",
            inputs=[
                io.Combo.Input("video_vae", options=choices, default=TINY_RANDOM,
                               tooltip="The video VAE from models/vae (minimax_h3_video_vae_fp16), or tiny-random."),
                io.Combo.Input("audio_vae", options=choices, default=TINY_RANDOM,
                               tooltip="The audio VAE from models/vae (minimax_h3_audio_vae_fp32), or tiny-random."),
                io.String.Input("folder", default="",
                                tooltip=FOLDER_TOOLTIP + " Both VAEs are then read from it."),
                io.Combo.Input("weight_dtype", options=list(DTYPES), default="bf16", optional=True,
                               tooltip="The video VAE decoder's dtype. bf16 is the reference pipeline's precision "
                                       "(encoder, norms and residual stream stay fp32) and decodes about 7.5x faster "
                                       "than fp32 on an H200; fp32 is the release's full precision; 'checkpoint' keeps "
                                       "each stored dtype. The audio VAE always runs in fp32, as released "
                                       "(a bf16 or fp16 file is widened)."),
            ],
            outputs=[H3VAE.Output(display_name="vae",
                                  tooltip="The video and audio VAEs together: connect to the vae of H3 Conditioning, "
                                          "H3 Add Guide, H3 VAE Encode / Decode, H3 Continuation or H3 Save MP4.")],
        )

    @classmethod
    def validate_inputs(cls, folder=None) -> bool | str:
        """A folder outside ComfyUI's model folders is refused at queue time."""
        return folder_problem(folder, "vae") or True

    @classmethod
    def fingerprint_inputs(cls, video_vae=None, audio_vae=None, folder="", **_) -> str:
        """The chosen files (or folder) as they are on disk now: saved over, they load again."""
        paths = [chosen_file("vae", name, folder) for name in (video_vae, audio_vae)]
        return files_fingerprint(*(path for path in paths if path))

    @classmethod
    def execute(cls, video_vae, audio_vae, folder, weight_dtype="bf16") -> io.NodeOutput:
        target = vae_device()
        folder = typed_path(folder, "vae")
        dtype = DTYPES[weight_dtype]
        video_path = folder or (None if video_vae == TINY_RANDOM else model_path("vae", video_vae, ""))
        audio_path = folder or (None if audio_vae == TINY_RANDOM else model_path("vae", audio_vae, ""))
        # the files checked (a wrong path, a damaged config, a missing tensor: said here), then room for them as
        # they will be held (an fp16 file's video VAE in fp32 takes twice its file; the audio VAE is widened to
        # fp32), before any weight is read
        checked = [check_video_vae(video_path, dtype)] if video_path else []
        checked += [check_audio_vae(audio_path)] if audio_path else []
        make_room(module_bytes(checked), target)
        with freed_on_failure(target):
            if video_path:
                video = load_video_vae(video_path, dtype=dtype, device=target, on_tensor=progress_and_interrupt())
            else:
                video = tiny_random_video_vae(target)  # fp32; like the tiny DiT, kept so on the CPU
                if dtype is not None and target.type != "cpu":
                    video.set_dtype(dtype)
            audio = (load_audio_vae(audio_path, device=target, on_tensor=progress_and_interrupt()) if audio_path
                     else tiny_random_audio_vae(target))
        name = folder or f"{video_vae} + {audio_vae}"
        patcher = manage(f"H3 VAEs ({name})", [video, audio], target, "vae")
        canvas = TINY_CANVAS if video_vae == TINY_RANDOM and not folder else RELEASE_CANVAS
        return io.NodeOutput(VAEHandle(video, audio, name, target, patcher=patcher, canvas=canvas))


NODES = [H3ModelLoader, H3TextEncoderLoader, H3VAELoader]
