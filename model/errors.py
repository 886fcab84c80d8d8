class ModelLoadError(Exception):
    """A model source that cannot be loaded; the message is one line naming the file and the problem."""


def one_line(error: BaseException) -> str:
    """An exception's message on one line (its type's name when it has none), for one-line errors."""
    return " ".join(str(error).split()) or type(error).__name__
