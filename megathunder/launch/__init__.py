"""Launching megathunder's processes: rank bootstrap from torchrun's or Slurm's environment."""
