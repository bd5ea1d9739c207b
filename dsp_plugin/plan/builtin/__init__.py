"""Built-in plans, found from the model's class name (or its ``_dsp_plan`` attribute).

Each plan is the whole of what DSP needs to know about the model; the line count
of each is reported in docs/models.md. By family: ``factorized`` (Latte, SVD, the
reference STDiT), ``cross_attention`` (Wan, SkyReels-V2, LTX-Video, Allegro),
``joint_attention`` (CogVideoX, ConsisID, EasyAnimate, HunyuanVideo, Framepack,
Mochi), ``wan_family`` (Wan VACE, Wan Animate, ChronoEdit, AnyFlow, Helios),
``mmdit`` (HunyuanVideo 1.5, Motif-Video), ``audio_video`` (LTX-2, Kandinsky 6,
MiniMax-H3) and ``linear_attention`` (SanaVideo); Cosmos and Kandinsky 5 are in
``cross_attention``; the video transformers no plan serves are refused, naming why
(``refused``). A model with a diffusers ``_cp_plan`` and no built-in plan gets one
derived from it (``from_cp_plan``). A plan given as a function is called with the
model (its paths depend on the model's depth, or it refuses a configuration it cannot
serve).
"""

from __future__ import annotations

from typing import Any

from dsp_plugin.log import get_logger
from dsp_plugin.plan.builtin.audio_video import MINIMAX_H3_PLAN, kandinsky6_plan, ltx2_plan
from dsp_plugin.plan.builtin.cross_attention import (
    ALLEGRO_PLAN,
    COSMOS_PLAN,
    LTX_VIDEO_PLAN,
    SKYREELS_V2_PLAN,
    WAN_PLAN,
    kandinsky5_plan,
)
from dsp_plugin.plan.builtin.factorized import LATTE_PLAN, SVD_PLAN, stdit_plan, stdit_schedule
from dsp_plugin.plan.builtin.from_cp_plan import plan_from_cp_plan
from dsp_plugin.plan.builtin.joint_attention import (
    COGVIDEOX_PLAN,
    EASYANIMATE_PLAN,
    HUNYUAN_VIDEO_FRAMES_PLAN,
    HUNYUAN_VIDEO_PLAN,
    MOCHI_PLAN,
    consisid_plan,
    framepack_plan,
    hunyuan_video_frames_plan,
    hunyuan_video_plan,
)
from dsp_plugin.plan.builtin.linear_attention import sana_video_plan
from dsp_plugin.plan.builtin.mmdit import HUNYUAN_VIDEO15_PLAN, motif_video_plan
from dsp_plugin.plan.builtin.refused import REFUSED
from dsp_plugin.plan.builtin.wan_family import (
    ANYFLOW_PLAN,
    CHRONOEDIT_PLAN,
    HELIOS_PLAN,
    WAN_ANIMATE_PLAN,
    WAN_VACE_PLAN,
)
from dsp_plugin.plan.spec import Heads

__all__ = ["ALLEGRO_PLAN", "ANYFLOW_PLAN", "BY_CLASS", "CHRONOEDIT_PLAN", "COGVIDEOX_PLAN", "COSMOS_PLAN",
           "EASYANIMATE_PLAN", "HELIOS_PLAN", "HUNYUAN_VIDEO15_PLAN", "HUNYUAN_VIDEO_FRAMES_PLAN",
           "HUNYUAN_VIDEO_PLAN", "LATTE_PLAN", "LTX_VIDEO_PLAN", "MINIMAX_H3_PLAN", "MOCHI_PLAN", "SKYREELS_V2_PLAN",
           "SVD_PLAN", "WAN_ANIMATE_PLAN", "WAN_PLAN", "WAN_VACE_PLAN", "builtin_plan", "consisid_plan",
           "framepack_plan", "hunyuan_video_frames_plan", "hunyuan_video_plan", "kandinsky5_plan", "kandinsky6_plan",
           "ltx2_plan", "motif_video_plan", "plan_from_cp_plan", "sana_video_plan", "stdit_plan", "stdit_schedule"]

BY_CLASS: dict[str, Any] = {
    "LatteTransformer3DModel": LATTE_PLAN,
    "TransformerSpatioTemporalModel": SVD_PLAN,
    "STDiT": stdit_plan,
    "WanTransformer3DModel": WAN_PLAN,
    "SkyReelsV2Transformer3DModel": SKYREELS_V2_PLAN,
    "LTXVideoTransformer3DModel": LTX_VIDEO_PLAN,
    "AllegroTransformer3DModel": ALLEGRO_PLAN,
    "CogVideoXTransformer3DModel": COGVIDEOX_PLAN,
    "ConsisIDTransformer3DModel": consisid_plan,
    "EasyAnimateTransformer3DModel": EASYANIMATE_PLAN,
    "HunyuanVideoTransformer3DModel": hunyuan_video_plan,
    "HunyuanVideoFramepackTransformer3DModel": framepack_plan,
    "MochiTransformer3DModel": MOCHI_PLAN,
    "WanVACETransformer3DModel": WAN_VACE_PLAN,
    "WanAnimateTransformer3DModel": WAN_ANIMATE_PLAN,
    "ChronoEditTransformer3DModel": CHRONOEDIT_PLAN,
    "AnyFlowTransformer3DModel": ANYFLOW_PLAN,
    "MiniMaxH3Transformer3DModel": MINIMAX_H3_PLAN,
    "LTX2VideoTransformer3DModel": ltx2_plan,
    "CosmosTransformer3DModel": COSMOS_PLAN,
    "Kandinsky5Transformer3DModel": kandinsky5_plan,
    "Kandinsky6Transformer3DModel": kandinsky6_plan,
    "MotifVideoTransformer3DModel": motif_video_plan,
    "HunyuanVideo15Transformer3DModel": HUNYUAN_VIDEO15_PLAN,
    "HeliosTransformer3DModel": HELIOS_PLAN,
    "SanaVideoTransformer3DModel": sana_video_plan,
    **REFUSED,  # refused at parallelize, naming why (refused.py)
}


def builtin_plan(model: Any) -> Any:
    """The plan for ``model``: its ``_dsp_plan``, else the built-in one for its class, else one derived from its
    diffusers ``_cp_plan`` (``from_cp_plan``: logged, one line), else None. A class that cannot be served is refused
    (``refused``), naming why."""
    own = getattr(model, "_dsp_plan", None)
    if own is not None:
        return own
    for cls in type(model).__mro__:
        if cls.__name__ in BY_CLASS:
            plan = BY_CLASS[cls.__name__]
            return plan(model) if callable(plan) else plan
    derived = plan_from_cp_plan(model)
    if derived is not None:
        heads = [path for path, specs in derived.items()
                 if any(isinstance(s, Heads) for s in (specs if isinstance(specs, list) else [specs]))]
        get_logger("dsp_plugin.plan").info(
            "parallelize: no built-in plan for %s; derived one from its diffusers _cp_plan: its splits and gathers, "
            "the text left whole, the head switch where diffusers uses Ulysses (%s)", type(model).__name__,
            ", ".join(heads) or "none")
    return derived
