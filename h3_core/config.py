"""Model configurations: the released checkpoint's values by default, any size from a dict.

Field names follow diffusers' `MiniMaxH3Transformer3DModel` config; `from_dict` also accepts the
original release's `transformer/config.json` spellings (h3-model.md A.1).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

# Original config.json spelling -> our (diffusers) field name.
_ORIGINAL_FIELD_NAMES = {
    "token_refiner_num_layers": "num_refiner_layers",
    "ffn_hidden_size": "ffn_dim",
    "latents_dim": "in_channels",
    "audio_latents_dim": "audio_in_channels",
    "timestep_input_dim": "freq_dim",
    "time_embed_hidden_size": "time_embed_hidden_dim",
    "rope_inv_freq_len": "rope_freq_dim",
}


@dataclass(frozen=True)
class DiTConfig:
    """Shape of the H3 DiT. Defaults are the released FL2VA / Ref2VA checkpoints (identical configs)."""

    num_attention_heads: int = 56
    attention_head_dim: int = 128
    hidden_size: int = 5376
    num_layers: int = 50
    num_refiner_layers: int = 2
    ffn_dim: int = 14336
    in_channels: int = 24
    audio_in_channels: int = 32
    patch_size: tuple[int, int, int] = (1, 2, 2)
    text_dim: int = 5120
    freq_dim: int = 256
    time_embed_hidden_dim: int = 5376
    time_embed_dim: int = 2688
    rope_freq_dim: int = 16
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    qk_norm_eps: float = 1e-5
    final_norm_eps: float = 1e-5
    # Curve-form ("pruned") checkpoints: > 0 = rows of the `adaln_t_table` that replaces the time embedder
    # (h3-model.md I.2); `time_embed_dim` is then the curve's width (8 in the published files).
    adaln_curve_grid: int = 0
    # FastVideo's VSA-trained checkpoints (FastH3 8-Step V2): each attention has a `to_gate_compress` linear
    # gating Video Sparse Attention's compressed branch (sparse_attention.py).
    vsa_gates: bool = False

    def __post_init__(self):
        self._check_types()
        object.__setattr__(self, "patch_size", tuple(int(p) for p in self.patch_size))
        if 6 * self.rope_freq_dim > self.attention_head_dim:
            raise ValueError(
                f"rope_freq_dim={self.rope_freq_dim} rotates {6 * self.rope_freq_dim} channels, more than "
                f"attention_head_dim={self.attention_head_dim}; it must be at most attention_head_dim / 6."
            )
        if self.freq_dim % 2:
            raise ValueError(f"freq_dim must be even (cos and sin halves), got {self.freq_dim}.")
        if self.adaln_curve_grid == 1 or self.adaln_curve_grid < 0:
            raise ValueError(f"adaln_curve_grid is 0 (a time embedder) or the curve table's rows (at least 2), "
                             f"got {self.adaln_curve_grid}.")

    def _check_types(self) -> None:
        """Every field a number of its kind (a config.json may say "abc", null or 2.5 for a layer count)."""
        def whole(value) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "patch_size":
                ok = isinstance(value, (tuple, list)) and len(value) == 3 and all(whole(p) and p > 0 for p in value)
                wanted = "three positive integers"
            elif field.type == "bool":
                ok, wanted = isinstance(value, bool), "true or false"
            elif field.type == "float":
                ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                      and value > 0)
                wanted = "a positive number"
            else:
                least = 0 if field.name in ("num_refiner_layers", "adaln_curve_grid") else 1
                ok, wanted = whole(value) and value >= least, f"an integer of at least {least}"
            if not ok:
                raise ValueError(f"The DiT config's {field.name} must be {wanted}, got {value!r}.")

    @property
    def curve_form(self) -> bool:
        """A pruned checkpoint's model: AdaLN over a sampled curve of the time embedding, no time embedder."""
        return self.adaln_curve_grid > 0

    @property
    def video_patch_dim(self) -> int:
        """Width of one packed video row: latent channels times the (t, h, w) patch volume."""
        pt, ph, pw = self.patch_size
        return self.in_channels * pt * ph * pw

    @property
    def inner_dim(self) -> int:
        """Attention width (heads x head_dim); 7168 > hidden 5376 in the real model."""
        return self.num_attention_heads * self.attention_head_dim

    @classmethod
    def from_dict(cls, raw: dict) -> "DiTConfig":
        """Build from a diffusers or original config.json; unknown keys (class names, versions) are ignored."""
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {}
        for key, value in raw.items():
            name = _ORIGINAL_FIELD_NAMES.get(key, key)
            if name in fields:
                values[name] = tuple(value) if name == "patch_size" and isinstance(value, list) else value
        return cls(**values)

    def to_dict(self) -> dict:
        """diffusers' config fields (and `adaln_curve_grid` for the curve form, `vsa_gates` for VSA-trained
        checkpoints, which diffusers does not have)."""
        out = dataclasses.asdict(self)
        out["patch_size"] = list(self.patch_size)
        if not self.curve_form:
            del out["adaln_curve_grid"]
        if not self.vsa_gates:
            del out["vsa_gates"]
        return out


# The diffusers conversion script's own fixture config: keeps the checkpoint-tied channels (24 video,
# 32 audio) and leaves 8 unrotated channels per head, so every code path of the real model runs.
TINY_DIT = DiTConfig(
    num_attention_heads=2,
    attention_head_dim=32,
    hidden_size=64,
    num_layers=2,
    num_refiner_layers=2,
    ffn_dim=128,
    in_channels=24,
    audio_in_channels=32,
    patch_size=(1, 2, 2),
    text_dim=48,
    freq_dim=16,
    time_embed_hidden_dim=64,
    time_embed_dim=32,
    rope_freq_dim=4,
)
