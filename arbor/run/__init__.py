"""The run: the RL loop and its phases, placement, recovery, checkpoints, metrics, eval, SFT."""
