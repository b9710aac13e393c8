"""Models: the family interface, one module per family (BridgeTower), the registry, loading and tokenizers."""
