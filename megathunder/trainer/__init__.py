"""The rank-0 controller: ``megathunder train`` (run.py), the Trainer, the schedules, replay and the run outputs."""
