"""The project's error types. Every failure on user input is one of these, never a bare crash."""


class ParityError(Exception):
    """Base class of every error v4parity raises on bad input."""


class GGUFError(ParityError):
    """The file is not a well-formed GGUF container (bad magic, truncated, out-of-bounds, ...)."""


class MetadataError(ParityError):
    """A metadata key is missing, mistyped or out of range for the deepseek4 contract."""


class TensorError(ParityError):
    """A tensor is missing, has the wrong shape/type, or holds non-finite values."""


class TraceError(ParityError):
    """A trace file is malformed; the message names file, line and field."""
