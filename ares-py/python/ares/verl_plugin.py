"""Registers ``ares.verl``'s estimators, losses, reward managers and trainer modes when imported.

verl 0.9.1 imports it in every process that imports verl — the driver, the TaskRunner, the
workers — through the ``verl.plugins`` entry point of the ``ares`` wheel: installing the wheel
is all it takes (``VERL_USE_EXTERNAL_PLUGINS=none`` turns verl's entry points off;
``actor_rollout_ref.model.external_lib=ares.verl_plugin`` or
``VERL_USE_EXTERNAL_MODULES=ares.verl_plugin`` name it explicitly instead).

Settings from the environment: ``ARES_VERL_COPY_TO_CPU`` (default ``1`` here: CUDA tensors
are copied to the host and the results back, since a stock worker cannot call
``register(copy_to_cpu=True)`` itself; ``0`` makes them an error), ``ARES_GRPO_LAMBDA`` (λ,
default 0.2), ``ARES_GRPO_LAMBDA_ALPHA`` (α, default 0.6), ``ARES_CORRECT_THRESHOLD``
(default 0.5).

verl swallows a plugin's import errors (logged at debug level); this module reports its own
failure as a warning naming the cause, then re-raises it.

Cost: registering the trainer modes imports verl's v1 trainer module in each process (about
1.5 s on a 2-core machine, on top of the ~7 s that ``import verl`` and its ``core_algos`` take
there).
"""

import logging
import os

from .verl import register


def _flag(name, default):
    value = os.environ.get(name, default).strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={value!r}: use 1 or 0")


try:
    registered = register(
        copy_to_cpu=_flag("ARES_VERL_COPY_TO_CPU", "1"),
        grpo_lambda=float(os.environ.get("ARES_GRPO_LAMBDA", "0.2")),
        grpo_lambda_alpha=float(os.environ.get("ARES_GRPO_LAMBDA_ALPHA", "0.6")),
        correct_threshold=float(os.environ.get("ARES_CORRECT_THRESHOLD", "0.5")),
    )
except Exception as e:  # verl would hide this at debug level
    logging.getLogger("ares.verl").warning("ares: the verl plugin did not register (%s: %s)", type(e).__name__, e)
    raise
