"""H3 Model Loader, H3 Text Encoder Loader, H3 VAE Loader: files from ComfyUI's model folders (or an
original release / partition folder, or `tiny-random`) -> handles on our own sockets."""

from __future__ import annotations

import torch
from comfy_api.latest import io

from h3_core.attention import EXACT_BACKENDS, LOSSY_BACKENDS, resolve_backend
from h3_core.checkpoint import load_dit
from h3_core.pipeline import TINY_CANVAS
from h3_core.references import RELEASE_CANVAS
from h3_core.text import load_text_encoder
from h3_core.tiny import (
    TINY_RANDOM,
    tiny_random_audio_vae,
    tiny_random_dit,
    tiny_random_video_vae,
)
from h3_core.tiny_text import tiny_random_text_encoder
from h3_core.vae_audio_checkpoint import load_audio_vae
from h3_core.vae_video_checkpoint import load_video_vae

from .common import (
    CATEGORY,
    DTYPES,
    H3VAE,
    H3Model,
    H3TextEncoder,
    device,
    model_choices,
    model_path,
)
from .convert import ModelHandle, TextEncoderHandle, VAEHandle

FOLDER_TOOLTIP = ("Optional: a folder of the original release (its root or a partition folder such as FL2VA/). "
                  "When set it is used instead of the file chosen above.")


class H3ModelLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3ModelLoader",
            display_name="H3 Model Loader",
            category=CATEGORY,
            description="Loads the MiniMax-H3 diffusion transformer (one partition) with the H3 engine.",
            inputs=[
                io.Combo.Input("checkpoint", options=model_choices("diffusion_models"), default=TINY_RANDOM,
                               tooltip="A file from models/diffusion_models (Comfy-Org names work), or tiny-random: "
                                       "a small random model for tests and demos."),
                io.String.Input("folder", default="", tooltip=FOLDER_TOOLTIP),
                io.Combo.Input("partition", options=["fl2va", "ref2va"], default="fl2va",
                               tooltip="fl2va serves t2va and fl2va (first/last frame); ref2va serves references."),
                io.Combo.Input("weight_dtype", options=list(DTYPES), default="bf16",
                               tooltip="Weight dtype (the release policy keeps projections and heads in fp32); "
                                       "'checkpoint' keeps each tensor's stored dtype."),
                io.Combo.Input("attention", options=["auto", *EXACT_BACKENDS, *LOSSY_BACKENDS], default="auto",
                               tooltip="Attention kernel: auto picks the fastest exact one available; sage is lossy."),
            ],
            outputs=[H3Model.Output(display_name="model")],
        )

    @classmethod
    def execute(cls, checkpoint, folder, partition, weight_dtype, attention) -> io.NodeOutput:
        target = device()
        resolve_backend(attention, target)  # an unavailable kernel fails before any weight is read
        dtype = DTYPES[weight_dtype]
        if checkpoint == TINY_RANDOM and not folder.strip():
            dit = tiny_random_dit(torch.float32 if target.type == "cpu" else (dtype or torch.bfloat16), target)
            name, tiny = TINY_RANDOM, True
        else:
            path = model_path("diffusion_models", checkpoint, folder)
            dit = load_dit(path, partition, dtype=dtype, device=target)
            name, tiny = str(path), False
        dit.set_attention_backend(attention)
        return io.NodeOutput(ModelHandle(dit, partition, name, target, tiny))


class H3TextEncoderLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3TextEncoderLoader",
            display_name="H3 Text Encoder Loader",
            category=CATEGORY,
            description="Loads H3's Qwen3-VL text conditioner (layer 50 hidden states).",
            inputs=[
                io.Combo.Input("text_encoder", options=model_choices("text_encoders"), default=TINY_RANDOM,
                               tooltip="A file from models/text_encoders (e.g. qwen3vl_32b_minimax_h3_bf16), "
                                       "or tiny-random for tests and demos."),
                io.String.Input("folder", default="", tooltip=FOLDER_TOOLTIP),
                io.String.Input("tokenizer_folder", default="",
                                tooltip="Needed with a single file: the release's FL2VA/tokenizer folder (or FL2VA/)."),
                io.Combo.Input("weight_dtype", options=["bf16", "fp16", "fp32"], default="bf16",
                               tooltip="dtype the encoder runs in."),
            ],
            outputs=[H3TextEncoder.Output(display_name="text_encoder")],
        )

    @classmethod
    def execute(cls, text_encoder, folder, tokenizer_folder, weight_dtype) -> io.NodeOutput:
        target = device()
        if text_encoder == TINY_RANDOM and not folder.strip():
            return io.NodeOutput(TextEncoderHandle(tiny_random_text_encoder(device=target), TINY_RANDOM, TINY_CANVAS))
        path = model_path("text_encoders", text_encoder, folder)
        encoder = load_text_encoder(path, DTYPES[weight_dtype], target, tokenizer=tokenizer_folder.strip() or None)
        return io.NodeOutput(TextEncoderHandle(encoder, str(path), RELEASE_CANVAS))


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
            ],
            outputs=[H3VAE.Output(display_name="vae")],
        )

    @classmethod
    def execute(cls, video_vae, audio_vae, folder) -> io.NodeOutput:
        target = device()
        folder = folder.strip()
        if folder:
            video, audio, name = load_video_vae(folder, device=target), load_audio_vae(folder, device=target), folder
        else:
            video = (tiny_random_video_vae(target) if video_vae == TINY_RANDOM
                     else load_video_vae(model_path("vae", video_vae, ""), device=target))
            audio = (tiny_random_audio_vae(target) if audio_vae == TINY_RANDOM
                     else load_audio_vae(model_path("vae", audio_vae, ""), device=target))
            name = f"{video_vae} + {audio_vae}"
        return io.NodeOutput(VAEHandle(video, audio, name, target))


NODES = [H3ModelLoader, H3TextEncoderLoader, H3VAELoader]
