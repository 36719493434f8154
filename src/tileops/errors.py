"""Exception types. Each is also the built-in type PyTorch would raise for the same mistake."""


class TileOpsError(Exception):
    """Base class of every error TileOPs raises on purpose."""


class TileOpsTypeError(TileOpsError, TypeError):
    """An argument has the wrong dtype or Python type."""


class TileOpsValueError(TileOpsError, ValueError):
    """An argument has the wrong shape, device or value."""


class TileOpsUnsupportedError(TileOpsError, ValueError):
    """A valid call that no kernel serves (size, layout or architecture)."""


class ManifestError(TileOpsError, ValueError):
    """A manifest entry is malformed or disagrees with the code."""


def op_error(cls: type[TileOpsError], op: str, arg: str, expected: str,
             got: object) -> TileOpsError:
    """Builds an error whose message names the op, the argument, what was expected and what came."""
    return cls(f"{op}: argument '{arg}': expected {expected}, got {got}")
