"""Exceptions raised by echospec.decoder. Both are ValueErrors so callers can catch bad input broadly."""


class UnsupportedModelError(ValueError):
    """The model cannot verify a tree: not a causal LM, flash/flex attention, a sliding-window or non-dynamic cache."""


class DecoderInputError(ValueError):
    """Bad input to the decoder: batch size > 1, a prompt past the model's positions, tree tokens out of range."""
