"""Small models for tests, docs and launches: not part of the DSP machinery.

``tiny``: diffusers' Latte, Wan and SVD transformers and pipelines at toy sizes (random weights, no
downloads). ``examples``: plain single-device models a plan is written for in docs/models.md
(``DividedSpaceTime``, ``VideoViT``, ``JointDiT``).
"""
