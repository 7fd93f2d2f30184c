"""Memory at each stage of a streamed step (no cap), against the planner's parts. One-off diagnostic."""
import json
import os

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
import torch  # noqa: E402

from dit_forward import build_ours, make_inputs  # noqa: E402
from h3_core.config import DiTConfig  # noqa: E402
from h3_core.memory_plan import GIB, activation_bytes, block_weight_bytes, shared_weight_bytes  # noqa: E402
from h3_core.offload import stream_blocks  # noqa: E402

config = DiTConfig()
model = build_ours(config)
for m in model.adaln_modules():
    m.to("cpu")
for block in model.blocks[14:]:
    block.to("cpu")
for block in model.blocks[:14]:
    block.adaln_proj.to("cpu")
torch.cuda.empty_cache()
mark = lambda name: print(json.dumps({name: round(torch.cuda.memory_allocated() / GIB, 3)}), flush=True)  # noqa: E731
mark("before_streamer")
streamer = stream_blocks(model, "cuda", 14, 1)
mark("after_streamer")
layout, inputs = make_inputs(config, 124, 512, 1344, 768)
tables = model.modulation_schedule([inputs["timesteps"]])[0]
mark("inputs_and_tables")
structure = dict(token_tags=layout.token_tags, position_ids=layout.position_ids, video_indices=layout.video_indices,
                 audio_indices=layout.audio_indices, text_indices=layout.text_indices)
torch.cuda.reset_peak_memory_stats()
with torch.inference_mode():
    model(**inputs, **structure, modulation=tables)
torch.cuda.synchronize()
mark("after_forward")
print(json.dumps({"peak": round(torch.cuda.max_memory_allocated() / GIB, 3),
                  "planner_shared": round(shared_weight_bytes(config, 2) / GIB, 3),
                  "planner_blocks_14_plus_3": round(17 * block_weight_bytes(config, 2) / GIB, 3),
                  "planner_activations": round(activation_bytes(config, layout.sequence_length, 2) / GIB, 3)}), flush=True)
