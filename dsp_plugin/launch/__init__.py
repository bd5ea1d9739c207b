"""The launches, installed with the package: ``python -m dsp_plugin.launch.<name>`` or the console scripts.

=====================  =========================  ===============================================
module                 console script             what
=====================  =========================  ===============================================
``train_dsp``          ``dsp-train``              the tiny STDiT with DSP (``make train``)
``sample``             ``dsp-sample``             a video from a diffusers Wan or Latte pipeline (.mp4, .gif, .pt)
``sample_latte``       ``dsp-sample-latte``       per-step latency and bytes of the tiny LattePipeline (.pt)
``train_deepspeed``    ``dsp-train-deepspeed``    DeepSpeed + DSP (``launch/run_deepspeed.sh``)
``pretrain_stdit``     ``dsp-pretrain-stdit``     ``megatron.training`` + DSP (``launch/run_megatron.sh``)
=====================  =========================  ===============================================

Under ``torchrun`` use the module form: ``torchrun --nproc-per-node 4 -m dsp_plugin.launch.train_dsp``.
"""
