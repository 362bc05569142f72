"""Registers ``ares.verl``'s estimators and losses when imported: name it in verl's
``VERL_USE_EXTERNAL_MODULES=ares.verl_plugin`` (read by ``import verl`` in every process, the
Ray workers included when the variable reaches them, e.g. through ``runtime_env.env_vars``).

Settings from the environment: ``ARES_VERL_COPY_TO_CPU=1`` (copy CUDA tensors to the host),
``ARES_GRPO_LAMBDA`` (λ, default 0.2), ``ARES_GRPO_LAMBDA_ALPHA`` (α, default 0.6),
``ARES_CORRECT_THRESHOLD`` (default 0.5).
"""

import os

from .verl import register

register(
    copy_to_cpu=os.environ.get("ARES_VERL_COPY_TO_CPU", "0").strip().lower() in ("1", "true", "yes"),
    grpo_lambda=float(os.environ.get("ARES_GRPO_LAMBDA", "0.2")),
    grpo_lambda_alpha=float(os.environ.get("ARES_GRPO_LAMBDA_ALPHA", "0.6")),
    correct_threshold=float(os.environ.get("ARES_CORRECT_THRESHOLD", "0.5")),
)
