"""What a person reads: megathunder's progress bars and summaries, not the libraries' chatter.

On CPU machines megatron-core, torch, vLLM and transformers print dozens of known-harmless lines
(Transformer Engine / Apex fallbacks, deprecation notices, Triton's missing CPU backend, NUMA
binding notes, checkpoint-loading bars). ``quiet_third_party`` filters exactly those, in this
process and -- through the environment -- in the processes it starts (vLLM's engine core imports
``megathunder.cli`` as its main module, which applies the same filters there). ``-v`` on the
command line, or ``MEGATHUNDER_VERBOSE=1``, shows everything.
"""

from __future__ import annotations

import logging
import os
import warnings

VERBOSE_ENV = "MEGATHUNDER_VERBOSE"
QUIET_ENV = "MEGATHUNDER_QUIET"  # set for child processes: apply the filters there too

HARMLESS_WARNINGS = (
    # (category, message regex): each seen on every CPU run, none about megathunder's use
    (UserWarning, r"Transformer Engine and Apex are not installed"),
    (UserWarning, r"Apex is not installed"),
    (UserWarning, r"full scope is deprecated"),
    (DeprecationWarning, r"The '[\w.]+' \s*module is deprecated"),
    (FutureWarning, r"`torch\.distributed\.\w+` is deprecated"),
    (UserWarning, r"TypedStorage is deprecated"),
    (FutureWarning, r"`(load|save)_state_dict` is deprecated"),  # megatron's dist_checkpointing on torch's
    (FutureWarning, r"Please use DTensor instead and we are deprecating ShardedTensor"),
)
QUIET_ENVIRONMENT = {
    "VLLM_LOGGING_LEVEL": "ERROR",  # vLLM's own log lines (its engine start, its per-request notes)
    "TORCH_CPP_LOG_LEVEL": "ERROR",  # c10 warnings such as the NUMA binding note
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # transformers' "Writing model shards" bars
    "TRANSFORMERS_VERBOSITY": "error",
    "WANDB_SILENT": "true",
}


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")


def quiet_third_party() -> None:
    """Filter the known-harmless third-party output here and in the processes started from here."""
    for key, value in QUIET_ENVIRONMENT.items():
        os.environ.setdefault(key, value)
    os.environ[QUIET_ENV] = "1"
    for category, message in HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=f".*{message}", category=category)
    # vLLM warns about Triton's missing CPU backend while it imports, before it configures its
    # loggers, through logging's last-resort handler: a level set first keeps it quiet.
    logging.getLogger("vllm").setLevel(logging.ERROR)
