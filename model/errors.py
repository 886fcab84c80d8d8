class ModelLoadError(Exception):
    """A model source that cannot be loaded; the message is one line naming the file and the problem."""
