"""Rollout: TreePO tree sampling and its budget rules, agents, tools, rewards, answer extraction."""
