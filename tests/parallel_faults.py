"""A model spec that fails on purpose, for tests/test_parallel.py. Its own small module because
every worker process imports it to unpickle the spec (the test module would drag in much more)."""

import dataclasses

import torch
import torch.distributed as dist

from h3_core.parallel import ModelSpec


@dataclasses.dataclass(frozen=True)
class FailingSpec(ModelSpec):
    """The tiny model, but rank `fail_rank` fails: while loading (fail_call 0) or in its n-th forward."""

    fail_rank: int = 1
    fail_call: int = 0
    compiling: bool = False  # fail as torch.compile does without a C++ compiler (Inductor's error) while loading

    def load(self, device, compute=None):
        if dist.get_rank() != self.fail_rank:
            return super().load(device, compute)
        if self.compiling:
            from torch._inductor.exc import InductorError

            raise InductorError(RuntimeError("No working C++ compiler found"), None)
        if self.fail_call == 0:
            raise RuntimeError("injected failure while loading")
        model, calls = super().load(device, compute), []

        def hook(module, args):
            calls.append(1)
            if len(calls) == self.fail_call:
                raise RuntimeError("injected failure in a forward")

        model.register_forward_pre_hook(hook)
        return model


@dataclasses.dataclass(frozen=True)
class NaNSpec(ModelSpec):
    """The tiny model with NaN in its video head: every rank samples NaN latents (a damaged file)."""

    def load(self, device, compute=None):
        model = super().load(device, compute)
        with torch.no_grad():
            model.final_layer.video_out.weight.fill_(float("nan"))
        return model


@dataclasses.dataclass(frozen=True)
class SlowSpec(ModelSpec):
    """The tiny model, read as slowly as the real DiT's 66 GB: each worker's load takes `seconds`."""

    seconds: float = 60.0

    def load(self, device, compute=None):
        import time

        time.sleep(self.seconds)
        return super().load(device, compute)
