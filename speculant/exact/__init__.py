"""What keeps the output exact: the sampler and its truncated distributions, the tree of drafted tokens, and
the verification of a chain or a tree of drafts (pure functions of tensors, tested by enumeration)."""
