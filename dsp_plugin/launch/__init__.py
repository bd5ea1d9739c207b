"""The launches, installed with the package: ``python -m dsp_plugin.launch.<name>`` or the console scripts.

=====================  =========================  ===============================================
module                 console script             what
=====================  =========================  ===============================================
``train_dsp``          ``dsp-train``              the tiny STDiT with DSP (``make train``)
``sample_latte``       ``dsp-sample-latte``       diffusers ``LattePipeline`` sampling, sharded
``train_deepspeed``    ``dsp-train-deepspeed``    DeepSpeed + DSP (``launch/run_deepspeed.sh``)
``pretrain_stdit``     ``dsp-pretrain-stdit``     ``megatron.training`` + DSP (``launch/run_megatron.sh``)
=====================  =========================  ===============================================

Under ``torchrun`` use the module form: ``torchrun --nproc-per-node 4 -m dsp_plugin.launch.train_dsp``.
"""
