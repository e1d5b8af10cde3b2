"""Tokenizers and the input pipeline."""
