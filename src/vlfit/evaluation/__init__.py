"""Evaluation: retrieval recall@k and caption-choice matching accuracy."""
