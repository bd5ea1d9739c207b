"""Built-in plans, found from the model's class name (or its ``_dsp_plan`` attribute).

Each plan is the whole of what DSP needs to know about the model; the line count
of each is reported in docs/models.md. By family: ``factorized`` (Latte, SVD, the
reference STDiT), ``cross_attention`` (Wan, SkyReels-V2, LTX-Video, Allegro),
``joint_attention`` (CogVideoX, ConsisID, EasyAnimate, HunyuanVideo, Framepack,
Mochi), ``wan_family`` (Wan VACE, Wan Animate, ChronoEdit, AnyFlow) and
``audio_video`` (LTX-2, MiniMax-H3). A plan given as a function is called with the model (its paths depend on
the model's depth, or it refuses a configuration it cannot serve).
"""

from __future__ import annotations

from typing import Any

from dsp_plugin.plan.builtin.audio_video import MINIMAX_H3_PLAN, ltx2_plan
from dsp_plugin.plan.builtin.cross_attention import ALLEGRO_PLAN, LTX_VIDEO_PLAN, SKYREELS_V2_PLAN, WAN_PLAN
from dsp_plugin.plan.builtin.factorized import LATTE_PLAN, SVD_PLAN, stdit_plan, stdit_schedule
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
from dsp_plugin.plan.builtin.wan_family import ANYFLOW_PLAN, CHRONOEDIT_PLAN, WAN_ANIMATE_PLAN, WAN_VACE_PLAN

__all__ = ["ALLEGRO_PLAN", "ANYFLOW_PLAN", "BY_CLASS", "CHRONOEDIT_PLAN", "COGVIDEOX_PLAN", "EASYANIMATE_PLAN",
           "HUNYUAN_VIDEO_FRAMES_PLAN", "HUNYUAN_VIDEO_PLAN", "LATTE_PLAN", "LTX_VIDEO_PLAN", "MINIMAX_H3_PLAN",
           "MOCHI_PLAN", "SKYREELS_V2_PLAN", "SVD_PLAN", "WAN_ANIMATE_PLAN", "WAN_PLAN", "WAN_VACE_PLAN",
           "builtin_plan", "consisid_plan", "framepack_plan", "hunyuan_video_frames_plan", "hunyuan_video_plan",
           "ltx2_plan", "stdit_plan", "stdit_schedule"]

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
}


def builtin_plan(model: Any) -> Any:
    """The plan for ``model``: its ``_dsp_plan``, else the built-in one for its class, else None."""
    own = getattr(model, "_dsp_plan", None)
    if own is not None:
        return own
    for cls in type(model).__mro__:
        if cls.__name__ in BY_CLASS:
            plan = BY_CLASS[cls.__name__]
            return plan(model) if callable(plan) else plan
    return None
