"""rope_ops inside other libraries' models.

- ``rope_ops.integrations.transformers``: Hugging Face transformers models rotate with rope_ops
  (``patch(model)``, ``patch_model_class("llama")``), in training and inference.
- ``rope_ops.integrations.kernels_hub``: a layer for the ``kernels`` package's mapping of
  ``rotary_pos_emb`` (what transformers' ``kernelize`` swaps in), with a backward.

Nothing here is imported by ``import rope_ops``; each integration imports its library lazily.
"""
