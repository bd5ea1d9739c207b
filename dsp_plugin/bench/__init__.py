"""Side-by-side benchmark of DSP against two DeepSpeed-Ulysses variants, Megatron-SP and Ring attention.

``python -m dsp_plugin.bench`` runs every method on N CPU gloo ranks with the
same model (adaLN + cross-attention) and input, with activation checkpointing
off and on, and measures traffic (from ``dsp_plugin.accounting``), memory and
paired step-time ratios; ``scale_model`` predicts the paper's 128-H100 settings
from the parameters in ``params`` (measured ones from a calibration JSON, see
``calibration``). See ``docs/benchmarks.md``.
"""
