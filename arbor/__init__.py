"""arbor: RL post-training for LLMs whose rollouts are trees.

Shared prefixes are generated once (SGLang's radix cache), credited as a tree (TreePO
subgroup advantages) and trained once (tree packing with exact gradients).
"""

__version__ = "0.1.0"
