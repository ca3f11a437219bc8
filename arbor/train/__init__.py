"""Training: advantages, tree packing, tree attention, log-probs, losses, the learner and ZeRO-3."""
