"""Models: BridgeTower presets and loading, offline tokenizers, unimodal encoders for retrieval."""
