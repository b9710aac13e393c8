"""Data flows one way: sources (encoded bytes) -> decode -> CPU stage -> collate -> device stage."""
