"""Side-by-side benchmark of DSP against DeepSpeed-Ulysses, Megatron-SP and Ring attention.

``python -m dsp_plugin.bench`` runs every method on N CPU gloo ranks with the
same model and input and measures traffic (from ``dsp_plugin.accounting``),
memory and step time; ``scale_model`` predicts the paper's 128-H100 settings
from the parameters in ``params``. See ``docs/benchmarks.md``.
"""
